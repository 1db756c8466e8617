"""Rotary-embedding frequencies: the one definition of the angles every backend rotates by."""

from __future__ import annotations

import math
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


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, scaling: Llama3RopeScaling | None,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [T, 1, head_dim // 2] for each token's own position, in `dtype`; the angles are
    position x frequency in float64."""
    inv = rope_inv_freq(head_dim, theta, scaling).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    return torch.cos(angles).to(dtype)[:, None, :], torch.sin(angles).to(dtype)[:, None, :]
