"""Portable rms_norm: per-row sums of squares by `row_sum`, dweight by `column_sum`."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics import grad_tree
from ...numerics.cpu_kernels import CpuKernels
from ...numerics.fixed_order import accumulate_dtype, column_sum, row_sum, rsqrt
from ...registry import register
from ...numerics.second_order import first_order_only


def weight_grad_rows(gxhat: Tensor, use: grad_tree.Use | None) -> Tensor | None:
    """dweight from grad * xhat [rows, H]: the fixed-order column sum over all rows, or, inside a
    unit tree, one partial per unit; a unit with several rows per token (heads) keeps them apart
    ([per_token, H]), for grad_tree.combine to reduce last."""
    hidden = gxhat.shape[1]
    per_token = use.per_token if use is not None else 1

    def partial(start: int, stop: int) -> Tensor:
        if per_token == 1:
            return column_sum(gxhat[start:stop])
        return column_sum(gxhat[start:stop].reshape(-1, per_token * hidden)).view(per_token, hidden)

    return grad_tree.per_unit(use, gxhat.shape[0], partial)


def inverse_rms(xf: Tensor, eps: float, *, kernels: CpuKernels | None = None) -> Tensor:
    """1 / sqrt(mean of squares + eps) of each row of xf [M, H] (accumulation dtype), the squares
    summed by `row_sum`, on the CPU kernels `kernels` (None: PyTorch's). lockstep.mode's RMSNorm
    uses it too."""
    return rsqrt(row_sum(xf * xf, kernels=kernels) / xf.shape[-1] + eps, kernels=kernels)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: float, kernels: CpuKernels | None) -> Tensor:
        acc = accumulate_dtype(x.dtype)
        xf = x.to(acc)
        rstd = inverse_rms(xf, eps, kernels=kernels)
        scale = weight.to(acc) + offset
        y = (xf * rstd[:, None]) * scale
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.kernels = offset, kernels
        ctx.use = grad_tree.capture("rms_norm", weight, x.shape[0], ctx.needs_input_grad[1])
        return y.to(x.dtype)

    @staticmethod
    @first_order_only("rms_norm")
    def backward(ctx, grad_y: Tensor):
        x, weight, rstd = ctx.saved_tensors
        acc = rstd.dtype
        g = grad_y.contiguous().to(acc)
        xhat = x.to(acc) * rstd[:, None]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gw = g * (weight.to(acc) + ctx.offset)
            dot = row_sum(gw * xhat, kernels=ctx.kernels) / x.shape[-1]
            dx = (rstd[:, None] * (gw - xhat * dot[:, None])).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = weight_grad_rows(g * xhat, ctx.use)
            dw = None if dw is None else dw.to(weight.dtype)
        return dx, dw, None, None, None


@register("portable", "rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float, *, kernels: CpuKernels | None = None) -> Tensor:
    """The portable rms_norm, its sums and square root on the CPU kernels `kernels` (None: PyTorch's)."""
    return _RMSNorm.apply(x.contiguous(), weight, eps, offset, kernels)
