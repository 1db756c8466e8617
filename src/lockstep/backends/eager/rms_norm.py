"""Eager rms_norm: RMSNorm as model code writes it: torch's mean, whose reduction splits with the
shape. Not invariant; for comparison."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register


@register("eager", "rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight.to(y.dtype) + offset) * y).to(x.dtype)
