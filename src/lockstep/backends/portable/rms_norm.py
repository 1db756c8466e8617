"""Portable rms_norm: per-row sums of squares by `row_sum`, dweight by `column_sum`."""

from __future__ import annotations

import torch
from torch import Tensor

from ...fixed_order import accumulate_dtype, column_sum, row_sum
from ...registry import register


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
        acc = accumulate_dtype(x.dtype)
        xf = x.to(acc)
        hidden = x.shape[-1]
        rstd = torch.rsqrt(row_sum(xf * xf) / hidden + eps)
        scale = weight.to(acc) + offset
        y = (xf * rstd[:, None]) * scale
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, weight, rstd = ctx.saved_tensors
        acc = rstd.dtype
        g = grad_y.contiguous().to(acc)
        xhat = x.to(acc) * rstd[:, None]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gw = g * (weight.to(acc) + ctx.offset)
            dot = row_sum(gw * xhat) / x.shape[-1]
            dx = (rstd[:, None] * (gw - xhat * dot[:, None])).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = column_sum(g * xhat).to(weight.dtype)
        return dx, dw, None, None


@register("portable", "rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    return _RMSNorm.apply(x.contiguous(), weight, eps, offset)
