"""Triton linear: forward, dX and dW all through the fixed-tile GEMM."""

from __future__ import annotations

import torch

from ...numerics import grad_tree
from ...numerics.fixed_order import split_sum
from ...registry import register
from ...numerics.second_order import first_order_only
from .gemm import gemm, weight_grad
from .reduce import column_sum


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, split_k, split_n):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.split_n = bias is not None, split_n
        ctx.use_w = grad_tree.capture("linear", weight, x.shape[0], ctx.needs_input_grad[1])
        ctx.use_b = grad_tree.capture("linear", bias, x.shape[0], ctx.needs_input_grad[2])
        if split_k == 1:
            return gemm(x, weight.t(), bias)
        # The reduction over K in split_k parts, combined by the canonical tree (fixed_order.split_sum).
        y = split_sum(lambda s, e: gemm(x[:, s:e], weight[:, s:e].t()), x.shape[1], split_k)
        return y if bias is None else y + bias

    @staticmethod
    @first_order_only("linear")
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = split_sum(lambda s, e: gemm(g[:, s:e], weight[s:e]), weight.shape[0], ctx.split_n)
        dw, db = grad_tree.linear_param_grads(ctx.use_w, ctx.use_b, g, x, weight.dtype, ctx.needs_input_grad[1],
                                              ctx.has_bias and ctx.needs_input_grad[2], weight_grad, column_sum)
        return dx, dw, db, None, None


@register("triton", "linear")
def linear(x, weight, bias, split_k=1, split_n=1):
    return _Linear.apply(x.contiguous(), weight, bias, split_k, split_n)
