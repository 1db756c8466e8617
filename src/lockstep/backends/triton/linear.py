"""Triton linear: forward, dX and dW all through the fixed-tile GEMM."""

from __future__ import annotations

import torch

from ...registry import register
from .gemm import gemm, weight_grad
from .reduce import column_sum


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return gemm(x, weight.t(), bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.contiguous()
        dx = gemm(g, weight) if ctx.needs_input_grad[0] else None
        dw = weight_grad(g, x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = column_sum(g).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


@register("triton", "linear")
def linear(x, weight, bias):
    return _Linear.apply(x.contiguous(), weight, bias)
