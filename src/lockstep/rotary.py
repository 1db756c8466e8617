"""Rotary-embedding frequencies: the one definition of the angles every backend rotates by.

The tables are built from correctly rounded inverse frequencies and IEEE operations alone
(lockstep.numerics.exact_math), on the CPU for every device, so their bits are the same on every machine:
PyTorch's pow, cos and sin in float64 take a vectorized math library on x86 and the C library in
its scalar kernels, and the two differ in the last bit (ADR 0021)."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import Tensor

from .numerics.exact_math import cos_sin_float64, power

# Positions at or above this are refused by ops.rope: their angles would leave cos_sin_float64's
# exact range at inverse frequencies up to 4 (every real model's are at most 1).
MAX_POSITION = 2 ** 24


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3 frequency scaling (rope_type "llama3" in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (rope_type "linear"): every frequency divided by `factor`; Gemma 3's
    global layers use it."""

    factor: float = 1.0


RopeScaling = Llama3RopeScaling | LinearRopeScaling


def rope_scaling_from_hf(rope: dict, where: str = "config.json") -> RopeScaling | None:
    """The scaling a Hugging Face rope_parameters / rope_scaling dict asks for; a ValueError naming
    `where` for a rope_type lockstep does not implement."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        return Llama3RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                 float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    if rope_type == "linear":
        return LinearRopeScaling(float(rope["factor"]))
    if rope_type not in ("default", None):
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported (expected 'default', 'linear' or 'llama3')")
    return None


def rope_scaling_to_hf(scaling: RopeScaling | None) -> dict:
    """The rope_parameters entries of `scaling` (rope_theta not included)."""
    if scaling is None:
        return {"rope_type": "default"}
    if isinstance(scaling, LinearRopeScaling):
        return {"rope_type": "linear", "factor": scaling.factor}
    return {"rope_type": "llama3", **dataclasses.asdict(scaling)}


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """Inverse frequencies [head_dim // 2] in float64: theta^(-2i/head_dim), optionally scaled
    (Llama 3, or linear).

    Shared by the kernels of every backend so that they rotate by the same angles; each
    theta^(-2i/head_dim) is correctly rounded (`_inverse_frequencies`), the scalings are IEEE
    operations, so the bits do not depend on the machine.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 0:
        raise ValueError(f"head_dim: expected an int >= 0, got {head_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
        raise ValueError(f"theta: expected a finite number > 1, got {theta!r}")
    inv = torch.tensor(_inverse_frequencies(head_dim, float(theta)), dtype=torch.float64)
    if scaling is None:
        return inv
    if isinstance(scaling, LinearRopeScaling):
        return inv / scaling.factor
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    mid = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, out)


@dataclass(frozen=True, eq=False)
class Positions:
    """Token positions [T] on their device with the host's own copy of their values, so that rope's
    checks and angle tables need not read the device: paged_cache.build_step makes one from the
    values the host already holds, and `Positions.read` from a device tensor, in one read. The
    range and the CPU copy are derived from `values`, so the two cannot disagree; editing `tensor`
    in place afterwards is not seen."""

    tensor: Tensor                  # [T] int64, on the tokens' device
    values: tuple[int, ...]         # the same T values, as Python ints
    host: Tensor = field(init=False)    # [T] int64 on the CPU
    low: int = field(init=False)        # the smallest value (0 when T == 0)
    high: int = field(init=False)       # the largest value (-1 when T == 0)

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, Tensor) or self.tensor.dtype != torch.int64 or self.tensor.dim() != 1:
            raise TypeError("positions: expected an int64 tensor [T] beside its values")
        if not isinstance(self.values, tuple) or len(self.values) != self.tensor.shape[0]:
            raise ValueError(f"positions: expected a tuple of {self.tensor.shape[0]} values, one per position")
        object.__setattr__(self, "host", torch.tensor(self.values, dtype=torch.int64))
        object.__setattr__(self, "low", min(self.values, default=0))
        object.__setattr__(self, "high", max(self.values, default=-1))

    @classmethod
    def read(cls, positions: Tensor) -> "Positions":
        """From an int tensor [T] on any device, read to the host once."""
        tensor = positions.long()
        return cls(tensor, tuple(tensor.tolist()))


@dataclass(frozen=True, eq=False)
class TablePositions:
    """Token positions [T] on their device, each below `limit`, without a host copy: rope gathers
    their angles on the device from a table of every position below `limit`, built once. Nothing of
    a step's values then reaches the host, which is what a CUDA graph replaying the step needs.
    The maker guarantees the bound (paged_cache.build_step checks it on the host)."""

    tensor: Tensor                  # [T] int64, on the tokens' device
    limit: int                      # every value is in [0, limit)
    # Gathered angles by (head_dim, theta, scaling, dtype): every layer rotates by the same ones.
    gathered: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, Tensor) or self.tensor.dtype != torch.int64 or self.tensor.dim() != 1:
            raise TypeError("positions: expected an int64 tensor [T]")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or not 1 <= self.limit <= MAX_POSITION:
            raise ValueError(f"limit: expected an int in [1, 2^24 = {MAX_POSITION}], got {self.limit!r}")


@dataclass(frozen=True)
class Rotation:
    """ops.rope's arguments besides x: how a step rotates its queries and keys, for an op that
    rotates them itself (ops.cached_attention's `rope`)."""

    positions: Tensor | Positions | TablePositions
    theta: float = 10000.0
    style: str = "neox"
    scaling: RopeScaling | None = None


def rope_cos_sin(positions: Tensor | Positions | TablePositions, head_dim: int, theta: float,
                 scaling: RopeScaling | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [T, 1, head_dim // 2] for each token's own position [T] (integers in
    [0, MAX_POSITION)), in `dtype`, on the positions' device; the angles are position x frequency
    in float64. Built on the CPU whatever the device (a GPU gets a copy: the same bits everywhere,
    and one copy instead of about 70 small kernels). Read-only: the last few results are reused,
    found by the positions' values, since every layer of a forward rotates its queries and keys by
    the same positions. A tensor is read to the host; a Positions brings its host copy; a TablePositions
    gathers the rows of its device table, the same bits, since a row is a function of its position."""
    if isinstance(positions, TablePositions):
        key = (head_dim, theta, scaling, dtype)
        hit = positions.gathered.get(key)
        if hit is None:
            cos, sin = _device_table(positions.limit, head_dim, theta, scaling, dtype, positions.tensor.device)
            with torch.inference_mode(False):
                hit = positions.gathered[key] = (cos.index_select(0, positions.tensor),
                                                 sin.index_select(0, positions.tensor))
        return hit
    if not isinstance(positions, Positions):
        positions = Positions.read(positions)
    device = positions.tensor.device
    key = (device, positions.values, head_dim, theta, scaling, dtype)
    with _RECENT_LOCK:
        hit = _RECENT.pop(key, None)
    if hit is None:
        # Outside inference mode, so that a result first made under it can still be saved for backward.
        with torch.inference_mode(False):
            cos, sin = _cos_sin_by_blocks(positions, head_dim, theta, scaling, dtype)
            hit = cos.to(device), sin.to(device)
    with _RECENT_LOCK:
        _RECENT[key] = hit
        while len(_RECENT) > 8:
            _RECENT.pop(next(iter(_RECENT)))
    return hit


def position_tensor(positions: Tensor | Positions | TablePositions) -> Tensor:
    """The positions' tensor on their device [T] (for backends that compute their own angles)."""
    return positions.tensor if isinstance(positions, (Positions, TablePositions)) else positions


# Unbounded, as a captured CUDA graph reads the table's memory: an entry evicted and freed would be
# read after its reuse. A process holds one per model and dtype.
@functools.cache
def _device_table(limit: int, head_dim: int, theta: float, scaling: RopeScaling | None, dtype: torch.dtype,
                  device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin [limit, 1, head_dim // 2] of every position below `limit`, on `device`."""
    with torch.inference_mode(False):
        cos, sin = _cos_sin(torch.arange(limit), head_dim, theta, scaling, dtype)
        return cos.to(device), sin.to(device)


# Recently computed (cos, sin) by their arguments, oldest first. The values are a function of the
# key alone, so reusing them changes no bit; the key holds the positions' values, not the tensor.
_RECENT: dict[tuple, tuple[Tensor, Tensor]] = {}
_RECENT_LOCK = threading.Lock()


# Positions per cached block of the CPU's tables, and the most blocks one call gathers from the
# cache: a decode step's positions fall in blocks already built, and a long prefill builds its own.
_BLOCK = 256
_MAX_BLOCKS = 16


def _cos_sin_by_blocks(positions: Positions, head_dim: int, theta: float, scaling: RopeScaling | None,
                       dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """_cos_sin's rows for `positions` (on the CPU), gathered from cached blocks of _BLOCK
    consecutive positions. A row is a function of its position alone, so the bits are _cos_sin's."""
    host = positions.host
    blocks = sorted({v // _BLOCK for v in positions.values})
    if not blocks or len(blocks) > _MAX_BLOCKS:
        return _cos_sin(host, head_dim, theta, scaling, dtype)
    tables = [_cos_sin_block(b, head_dim, theta, scaling, dtype) for b in blocks]
    cos, sin = (torch.cat([t[i] for t in tables]) if len(tables) > 1 else tables[0][i] for i in (0, 1))
    rows = torch.searchsorted(torch.tensor(blocks), host // _BLOCK) * _BLOCK + host % _BLOCK
    return cos[rows], sin[rows]


@functools.lru_cache(maxsize=64)
def _cos_sin_block(block: int, head_dim: int, theta: float, scaling: RopeScaling | None,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _cos_sin(torch.arange(block * _BLOCK, (block + 1) * _BLOCK), head_dim, theta, scaling, dtype)


def _cos_sin(positions: Tensor, head_dim: int, theta: float, scaling: RopeScaling | None,
             dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    inv = rope_inv_freq(head_dim, theta, scaling).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = cos_sin_float64(angles)
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


@functools.lru_cache(maxsize=64)
def _inverse_frequencies(head_dim: int, theta: float) -> tuple[float, ...]:
    """theta^(-k/head_dim) for k = 0, 2, 4, ... < head_dim, each correctly rounded to float64."""
    return tuple(power(theta, Fraction(-k, head_dim)) for k in range(0, head_dim, 2))
