"""Rotary-embedding frequencies: the one definition of the angles every backend rotates by."""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass

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

    Shared by the kernels of every backend so that they rotate by the same angles; computed in
    float64 because it is tiny and exactness here is free.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
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
    position x frequency in float64. Read-only: on the CPU the last few results are reused, since
    every layer of a forward rotates its queries and keys by the same positions."""
    if positions.device.type != "cpu":
        return _cos_sin(positions, head_dim, theta, scaling, dtype)
    key = (positions.dtype, tuple(positions.shape), positions.numpy().tobytes(), head_dim, theta, scaling, dtype)
    with _RECENT_LOCK:
        hit = _RECENT.pop(key, None)
    if hit is None:
        # Outside inference mode, so that a result first made under it can still be saved for backward.
        with torch.inference_mode(False):
            hit = _cos_sin(positions.clone(), head_dim, theta, scaling, dtype)
    with _RECENT_LOCK:
        _RECENT[key] = hit
        while len(_RECENT) > 8:
            _RECENT.pop(next(iter(_RECENT)))
    return hit


# Recently computed (cos, sin) by their arguments, oldest first. The values are a function of the
# key alone, so reusing them changes no bit; the key holds the positions' values, not the tensor.
_RECENT: dict[tuple, tuple[Tensor, Tensor]] = {}
_RECENT_LOCK = threading.Lock()


def _cos_sin(positions: Tensor, head_dim: int, theta: float, scaling: RopeScaling | None,
             dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    inv = rope_inv_freq(head_dim, theta, scaling).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    return torch.cos(angles).to(dtype)[:, None, :], torch.sin(angles).to(dtype)[:, None, :]
