"""Eager rope: Rotary embedding as model code writes it (fp32 angles from lockstep.rotary's
frequencies). Not invariant; for comparison."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from ...rotary import position_tensor, rope_inv_freq


@register("eager", "rope")
def rope(x: Tensor, positions: Tensor, theta: float, style: str, scaling) -> Tensor:
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = rope_inv_freq(x.shape[-1], theta, scaling).to(device=x.device, dtype=dt)
    angles = position_tensor(positions).to(dt)[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    xf = x.to(dt)
    if style == "neox":
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)
