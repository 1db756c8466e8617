"""Portable silu_mul, composed from primitives whose bits do not depend on the code path.

torch.sigmoid and torch.nn.functional.silu give different fp32 bits in the vectorised loop and in
its scalar tail, so an element's result would depend on where it falls in a thread's chunk;
exp and division do not (tests/test_primitives.py guards this).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...fixed_order import accumulate_dtype
from ...registry import register


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)), path-independent (shared with gelu_mul). In place after the first op"""
    # In place after the first op: the same arithmetic, without a full-size temporary per step.
    return torch.exp(-x).add_(1.0).reciprocal_()


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        acc = accumulate_dtype(gate.dtype)
        g = gate.to(acc)
        ctx.save_for_backward(gate, up)
        return sigmoid(g).mul_(g).mul_(up.to(acc)).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        gate, up = ctx.saved_tensors
        acc = accumulate_dtype(gate.dtype)
        g, u, dy = gate.to(acc), up.to(acc), grad_y.contiguous().to(acc)
        s = sigmoid(g)
        gs = g * s
        dup = (dy * gs).to(up.dtype)
        # d silu / d g = s * (1 + g * (1 - s)) = s + gs * (1 - s)
        dsilu = (1.0 - s).mul_(gs).add_(s)
        dgate = (dy * u).mul_(dsilu).to(gate.dtype)
        return dgate, dup


@register("portable", "silu_mul")
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return _SiluMul.apply(gate.contiguous(), up.contiguous())
