"""Rotary-embedding frequencies: the one definition of the angles every backend rotates by.

The tables are built from correctly rounded inverse frequencies and IEEE additions, multiplications
and roundings alone, so their bits are the same on every CPU, vector unit and GPU: PyTorch's pow, cos
and sin in float64 take a vectorized math library on x86 and the C library in its scalar kernels,
and the two differ in the last bit (ADR 0021)."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from dataclasses import dataclass
from decimal import Decimal, localcontext
from fractions import Fraction

import torch
from torch import Tensor


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


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, scaling: RopeScaling | None,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [T, 1, head_dim // 2] for each token's own position, in `dtype`; the angles are
    position x frequency in float64. Read-only: the last few results are reused, since every layer
    of a forward rotates its queries and keys by the same positions. On the CPU they are found by
    the positions' values; on a GPU, where reading the values would wait for the device, by the
    positions tensor itself, while that object is alive and unmodified (its version counter)."""
    on_cpu = _keyed_by_values(positions)
    if on_cpu:
        key = ("values", positions.dtype, tuple(positions.shape), positions.numpy().tobytes(), head_dim, theta,
               scaling, dtype)
    else:
        key = ("tensor", id(positions), positions._version, head_dim, theta, scaling, dtype)
    with _RECENT_LOCK:
        hit = _RECENT.pop(key, None)
    if hit is not None and not on_cpu and hit[0]() is not positions:
        hit = None                              # another tensor now has the id of a freed one
    if hit is None:
        # Outside inference mode, so that a result first made under it can still be saved for backward.
        with torch.inference_mode(False):
            build = _cos_sin_by_blocks if on_cpu else _cos_sin
            hit = (None if on_cpu else weakref.ref(positions), build(positions.clone(), head_dim, theta, scaling, dtype))
    with _RECENT_LOCK:
        _RECENT[key] = hit
        while len(_RECENT) > 8:
            _RECENT.pop(next(iter(_RECENT)))
    return hit[1]


def _keyed_by_values(positions: Tensor) -> bool:
    return positions.device.type == "cpu"


# Recently computed (cos, sin) by their arguments, oldest first, each with a weak reference to the
# positions tensor where the key names it by id. The values are a function of the key alone, so
# reusing them changes no bit.
_RECENT: dict[tuple, tuple[weakref.ref | None, tuple[Tensor, Tensor]]] = {}
_RECENT_LOCK = threading.Lock()


# Positions per cached block of the CPU's tables, and the most blocks one call gathers from the
# cache: a decode step's positions fall in blocks already built, and a long prefill builds its own.
_BLOCK = 256
_MAX_BLOCKS = 16


def _cos_sin_by_blocks(positions: Tensor, head_dim: int, theta: float, scaling: RopeScaling | None,
                       dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """_cos_sin's rows for `positions` [T] (CPU), gathered from cached blocks of _BLOCK consecutive
    positions. A row is a function of its position alone, so the bits are _cos_sin's."""
    blocks = torch.unique(positions // _BLOCK) if positions.numel() else positions
    if not 0 < blocks.numel() <= _MAX_BLOCKS:
        return _cos_sin(positions, head_dim, theta, scaling, dtype)
    tables = [_cos_sin_block(int(b), head_dim, theta, scaling, dtype) for b in blocks]
    cos, sin = (torch.cat([t[i] for t in tables]) if len(tables) > 1 else tables[0][i] for i in (0, 1))
    rows = torch.searchsorted(blocks, positions // _BLOCK) * _BLOCK + positions % _BLOCK
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
    """theta^(-k/head_dim) for k = 0, 2, 4, ... < head_dim, each correctly rounded to float64:
    evaluated in 50-digit decimal arithmetic (Python's, the same on every machine), rounded once."""
    if not math.isfinite(theta) or theta <= 1:
        raise ValueError(f"theta: expected a finite number > 1, got {theta!r}")
    with localcontext() as ctx:
        ctx.prec = 50
        log_theta = Decimal(theta).ln()
        return tuple(float((log_theta * -k / head_dim).exp()) for k in range(0, head_dim, 2))


_PI = Fraction(Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899"))


def _leading_parts(value: Fraction, parts: int, bits: int) -> tuple[float, ...]:
    """`value` as a sum of `parts` floats of `bits` significant bits each (and a remainder below the
    last): n * part is exact in float64 for |n| < 2^(53 - bits)."""
    out = []
    for _ in range(parts):
        exponent = value.numerator.bit_length() - value.denominator.bit_length()
        scale = Fraction(2) ** (bits - 1 - exponent)
        part = Fraction(math.floor(value * scale)) / scale
        out.append(float(part))
        value -= part
    return tuple(out)


# pi/2 in four 26-bit parts: the reduction below is exact in its products for |angle| < 2^26 pi.
_HALF_PI_PARTS = _leading_parts(_PI / 2, 4, 26)
_TWO_OVER_PI = float(2 / _PI)
# Taylor coefficients, each 1/n! correctly rounded: sin to r^17, cos to r^18; on |r| <= pi/4 the
# first omitted terms are below 2^-60 of the result.
_SIN_COEFFS = tuple(float(Fraction((-1) ** k, math.factorial(2 * k + 1))) for k in range(1, 9))
_COS_COEFFS = tuple(float(Fraction((-1) ** k, math.factorial(2 * k))) for k in range(1, 10))


def cos_sin_float64(angles: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, sin) of float64 `angles` (any shape, |angle| < 2^26 pi for full accuracy) from IEEE
    additions, multiplications and roundings alone, so the bits are the same on every device and
    vector unit (each op its own kernel: nothing is fused into an FMA). Within 1 ulp of torch.cos
    and torch.sin at rotary angles (tests/test_rope.py).

    The angle is reduced by the nearest multiple n of pi/2 (Cody-Waite, in four exact products),
    cos and sin of the remainder r (|r| <= pi/4) are Taylor series in r^2 by Horner's rule, and n
    mod 4 picks which of +-cos r, +-sin r each result is."""
    if angles.dtype != torch.float64:
        raise ValueError(f"angles: expected float64, got {angles.dtype}")
    n = torch.round(angles * _TWO_OVER_PI)
    r = angles
    for part in _HALF_PI_PARTS:
        r = r - n * part
    z = r * r
    sin_r = _horner(z, _SIN_COEFFS)
    sin_r = r + (r * z) * sin_r
    cos_r = 1.0 + z * _horner(z, _COS_COEFFS)
    quadrant = n.to(torch.int64) & 3
    cos = torch.where(quadrant == 0, cos_r, torch.where(quadrant == 1, -sin_r, torch.where(quadrant == 2, -cos_r, sin_r)))
    sin = torch.where(quadrant == 0, sin_r, torch.where(quadrant == 1, cos_r, torch.where(quadrant == 2, -sin_r, -cos_r)))
    return cos, sin


def _horner(z: Tensor, coeffs: tuple[float, ...]) -> Tensor:
    """coeffs[0] + coeffs[1] z + coeffs[2] z^2 + ..., from the highest term down."""
    acc = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * z + c
    return acc
