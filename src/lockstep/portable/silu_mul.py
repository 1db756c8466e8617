"""Portable silu_mul, composed from primitives whose bits do not depend on the code path.

torch.sigmoid and torch.nn.functional.silu give different fp32 bits in the vectorised loop and in
its scalar tail, so an element's result would depend on where it falls in a thread's chunk;
exp and division do not (tests/test_primitives.py guards this).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import register
from .fixed_order import accumulate_dtype


def _sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        acc = accumulate_dtype(gate.dtype)
        g = gate.to(acc)
        ctx.save_for_backward(gate, up)
        return ((g * _sigmoid(g)) * up.to(acc)).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        gate, up = ctx.saved_tensors
        acc = accumulate_dtype(gate.dtype)
        g, u, dy = gate.to(acc), up.to(acc), grad_y.contiguous().to(acc)
        s = _sigmoid(g)
        dgate = (dy * u) * (s * (1.0 + g * (1.0 - s)))
        dup = dy * (g * s)
        return dgate.to(gate.dtype), dup.to(up.dtype)


@register("portable", "silu_mul")
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return _SiluMul.apply(gate.contiguous(), up.contiguous())
