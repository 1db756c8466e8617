"""Portable log_softmax: exact row max, fixed-order `row_sum` of exponentials."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics.fixed_order import accumulate_dtype, log_softmax_rows, log_softmax_rows_backward
from ...numerics.cpu_kernels import CpuKernels
from ...registry import register
from ...numerics.second_order import first_order_only


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, kernels: CpuKernels | None) -> Tensor:
        y = log_softmax_rows(x.to(accumulate_dtype(x.dtype)), kernels=kernels)
        # The fp32 result is kept for backward: recomputing softmax from a bf16 output would lose
        # the precision the forward just paid for.
        ctx.save_for_backward(y)
        ctx.dtype, ctx.kernels = x.dtype, kernels
        return y.to(x.dtype)

    @staticmethod
    @first_order_only("log_softmax")
    def backward(ctx, grad_y: Tensor):
        (y,) = ctx.saved_tensors
        return log_softmax_rows_backward(grad_y.contiguous().to(y.dtype), y, kernels=ctx.kernels).to(ctx.dtype), None


@register("portable", "log_softmax")
def log_softmax(x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """The portable log_softmax, its exp and log on the CPU kernels `kernels` (None: PyTorch's)."""
    return _LogSoftmax.apply(x.contiguous(), kernels)
