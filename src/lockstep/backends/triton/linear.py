"""Triton linear: forward, dX and dW all through the fixed-tile GEMM. Its `group` form
(`forward_group`) makes the engine's projections of one input in one launch."""

from __future__ import annotations

import torch

from ...numerics import grad_tree
from ...numerics.fixed_order import split_sum
from ...registry import register
from ...numerics.second_order import first_order_only
from .gemm import GROUP_MAX, gemm, gemm_group, weight_grad
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


def forward_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """[linear(x, w, b) for w, b in zip(weights, biases)] without a gradient (x [M, K], each w [N_j, K]
    -> [M, N_j] in x's dtype): one launch of gemm_group where the weights share a layout and all or
    none have a bias (every model's q/k/v and gate/up), with each product's own tiles and so its
    bits; else a launch each."""
    if 1 <= len(weights) <= GROUP_MAX and all(w.stride() == weights[0].stride() for w in weights) \
            and len({b is None for b in biases}) == 1:
        return gemm_group(x, [w.t() for w in weights], biases)
    return [gemm(x, w.t(), b) for w, b in zip(weights, biases)]


# ops.linears' form of this backend (docs/adr/0042): the engine's projections of one input in one launch.
linear.group = forward_group
