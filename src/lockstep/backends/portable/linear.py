"""Portable linear: fixed-shape row tiles forward and dX, fixed row blocks for dW and dbias."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ...numerics import grad_tree
from ...numerics.cpu_kernels import CpuKernels
from ...numerics.fixed_order import column_sum, matmul_rows, split_matmul_rows, weight_grad, weight_grad_node
from ...registry import register
from ...numerics.second_order import first_order_only


def linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int = 1, *,
                   kernels: CpuKernels | None = None) -> Tensor:
    """x [M, K] @ weight[N, K].T + bias [N] -> [M, N] in x's dtype; the reduction over K in
    `split_k` parts combined by the canonical tree (the bias added after); the GEMMs on the CPU
    kernels `kernels` (None: PyTorch's)."""
    if split_k == 1:
        y = matmul_rows(x, weight.t(), bias, kernels=kernels)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    y = split_matmul_rows(x, weight.t(), split_k, kernels=kernels)
    return (y if bias is None else y + bias).to(x.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int, split_n: int,
                kernels: CpuKernels | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.split_n, ctx.kernels = bias is not None, split_n, kernels
        ctx.use_w = grad_tree.capture("linear", weight, x.shape[0], ctx.needs_input_grad[1])
        ctx.use_b = grad_tree.capture("linear", bias, x.shape[0], ctx.needs_input_grad[2])
        return linear_forward(x, weight, bias, split_k, kernels=kernels)

    @staticmethod
    @first_order_only("linear")
    def backward(ctx, grad_y: Tensor):
        x, weight = ctx.saved_tensors
        kernels = ctx.kernels
        grad_y = grad_y.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = split_matmul_rows(grad_y, weight, ctx.split_n, kernels=kernels).to(x.dtype)
        dw, db = grad_tree.linear_param_grads(ctx.use_w, ctx.use_b, grad_y, x, weight.dtype, ctx.needs_input_grad[1],
                                              ctx.has_bias and ctx.needs_input_grad[2],
                                              functools.partial(weight_grad, kernels=kernels), column_sum,
                                              functools.partial(weight_grad_node, kernels=kernels))
        return dx, dw, db, None, None, None


@register("portable", "linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int = 1, split_n: int = 1, *,
           kernels: CpuKernels | None = None) -> Tensor:
    """The portable linear, its GEMMs on the CPU kernels `kernels` (None: PyTorch's; the native
    backend passes its own)."""
    if not torch.is_grad_enabled():  # no graph to record (the engine's steps): the forward alone
        return linear_forward(x.contiguous(), weight, bias, split_k, kernels=kernels)
    return _Linear.apply(x.contiguous(), weight, bias, split_k, split_n, kernels)
