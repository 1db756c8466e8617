"""rope: rotary position embedding at arbitrary positions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..backend import resolve
from . import _checks as c

STYLES = ("neox", "gptj")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3 frequency scaling (rope_type "llama3" in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> Tensor:
    """Inverse frequencies [head_dim // 2] in float64: theta^(-2i/head_dim), optionally Llama-3 scaled.

    Shared by the kernels of every backend so that they rotate by the same angles; computed in
    float64 because it is tiny and exactness here is free.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    mid = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, out)


def rope(x: Tensor, positions: Tensor, theta: float = 10000.0, style: str = "neox",
         scaling: Llama3RopeScaling | None = None) -> Tensor:
    """Rotate x by its positions.

    x: [tokens, heads, head_dim] float (head_dim even); positions: [tokens] int, any values >= 0.
    style "neox" rotates the two halves of head_dim against each other (Llama, Qwen); "gptj" rotates
    interleaved pairs. Returns x's shape and dtype; angles in float64, rotation in fp32.
    """
    c.float_tensor("x", x)
    c.ndim("x", x, 3, "a 3-D tensor [tokens, heads, head_dim]")
    if x.shape[-1] % 2:
        raise ValueError(f"x: expected an even head_dim, got {x.shape[-1]}")
    c.int_tensor("positions", positions)
    c.same_device("positions", positions, "x", x)
    if tuple(positions.shape) != (x.shape[0],):
        raise ValueError(f"positions: expected shape [{x.shape[0]}] (one per token of x), got {tuple(positions.shape)}")
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions: expected values >= 0, found {int(positions.min())}")
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
        raise ValueError(f"theta: expected a finite number > 1, got {theta!r}")
    if style not in STYLES:
        raise ValueError(f"style: expected one of {STYLES}, got {style!r}")
    if scaling is not None and not isinstance(scaling, Llama3RopeScaling):
        raise TypeError(f"scaling: expected a Llama3RopeScaling or None, got {type(scaling).__name__}")
    return resolve("rope", x.device)(x, positions.long(), float(theta), style, scaling)
