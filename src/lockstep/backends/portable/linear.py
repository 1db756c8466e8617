"""Portable linear: fixed-shape row tiles forward and dX, fixed row blocks for dW and dbias."""

from __future__ import annotations

import torch
from torch import Tensor

from ...fixed_order import column_sum, matmul_rows, weight_grad
from ...registry import register


def linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] @ weight[N, K].T + bias [N] -> [M, N] in x's dtype."""
    return matmul_rows(x, weight.t(), bias).to(x.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = matmul_rows(grad_y, weight).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(grad_y, x).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = column_sum(grad_y).to(weight.dtype)
        return dx, dw, db


@register("portable", "linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _Linear.apply(x.contiguous(), weight, bias)
