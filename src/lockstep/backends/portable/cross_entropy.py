"""Portable cross_entropy: per-row losses as in log_softmax, summed over rows by `column_sum`."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics.fixed_order import accumulate_dtype, exp, reduce_losses, row_scale, shifted_and_lse
from ...numerics.cpu_kernels import CpuKernels
from ...registry import register
from ...numerics.second_order import first_order_only


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int, reduction: str,
                kernels: CpuKernels | None) -> Tensor:
        xf = logits.to(accumulate_dtype(logits.dtype))
        shifted, lse = shifted_and_lse(xf, kernels=kernels)
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        picked = shifted.gather(1, safe[:, None])[:, 0]
        loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
        count = valid.sum()
        ctx.save_for_backward(shifted, lse, safe, valid, count)
        ctx.reduction = reduction
        ctx.dtype, ctx.kernels = logits.dtype, kernels
        return reduce_losses(loss, count, reduction, logits.dtype)

    @staticmethod
    @first_order_only("cross_entropy")
    def backward(ctx, grad: Tensor):
        shifted, lse, safe, valid, count = ctx.saved_tensors
        acc = shifted.dtype
        scale = row_scale(grad, ctx.reduction, count, shifted.shape[0], acc)
        d = exp(shifted - lse[:, None], kernels=ctx.kernels)
        d.scatter_(1, safe[:, None], d.gather(1, safe[:, None]) - 1.0)
        # where, not a multiply by zero: an ignored row holding NaN must still get a zero gradient.
        d = torch.where(valid[:, None], d * scale[:, None], torch.zeros_like(d))
        return d.to(ctx.dtype), None, None, None, None


@register("portable", "cross_entropy")
def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str, *,
                  kernels: CpuKernels | None = None) -> Tensor:
    """The portable cross_entropy, its exp and log on the CPU kernels `kernels` (None: PyTorch's)."""
    return _CrossEntropy.apply(logits.contiguous(), targets, ignore_index, reduction, kernels)
