"""Float64 reference rope: the textbook formula, written for clarity; shares no code with the
kernels."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...registry import register
from ...rotary import position_tensor

f64 = torch.float64


def rope(x: Tensor, positions: Tensor, theta: float = 10000.0, style: str = "neox", scaling=None) -> Tensor:
    x = x.to(f64)
    d = x.shape[-1]
    freqs = []
    for i in range(d // 2):
        f = theta ** (-2.0 * i / d)
        if scaling is not None and not hasattr(scaling, "low_freq_factor"):      # linear: interpolated positions
            f = f / scaling.factor
        elif scaling is not None:
            old = scaling.original_max_position_embeddings
            wavelength = 2 * math.pi / f
            if wavelength > old / scaling.low_freq_factor:
                f = f / scaling.factor
            elif wavelength >= old / scaling.high_freq_factor:
                s = (old / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
                f = (1 - s) * f / scaling.factor + s * f
        freqs.append(f)
    angle = position_tensor(positions).to(f64)[:, None] * torch.tensor(freqs, dtype=f64, device=x.device)[None, :]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    if style == "neox":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


register("reference", "rope")(rope)
