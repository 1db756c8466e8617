"""Portable silu_mul, composed from primitives whose bits do not depend on the code path.

torch.sigmoid and torch.nn.functional.silu give different fp32 bits in the vectorised loop and in
its scalar tail, so an element's result would depend on where it falls in a thread's chunk;
exp and division do not (tests/test_portable.py guards this). The chain runs on cache-sized row
chunks (lockstep.numerics.chunks), which changes no bit.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from ...numerics.chunks import row_chunks
from ...numerics.fixed_order import accumulate_dtype, exp
from ...numerics.cpu_kernels import CpuKernels
from ...registry import register
from ...numerics.second_order import first_order_only


def sigmoid(x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """1 / (1 + exp(-x)), path-independent (shared with gelu_mul), the exp on the CPU kernels
    `kernels` (None: PyTorch's)."""
    # In place after the first op: the same arithmetic, without a full-size temporary per step.
    return exp(-x, kernels=kernels).add_(1.0).reciprocal_()


def gated_forward(act: Callable[[Tensor], Tensor], gate: Tensor, up: Tensor) -> Tensor:
    """act(gate) * up for rows [n, F], computed in the accumulation dtype chunk by chunk; `act`
    maps an accumulation-dtype chunk to a new tensor. Returns [n, F] in gate's dtype."""
    acc = accumulate_dtype(gate.dtype)
    out = torch.empty_like(gate)
    for s, e in row_chunks(gate.shape[0], gate.shape[1]):
        out[s:e] = act(gate[s:e].to(acc)).mul_(up[s:e].to(acc))
    return out


def gated_backward(act_and_derivative: Callable[[Tensor], tuple[Tensor, Tensor]], gate: Tensor, up: Tensor,
                   grad_y: Tensor) -> tuple[Tensor, Tensor]:
    """(d gate, d up) of y = act(gate) * up for rows [n, F], chunk by chunk in the accumulation
    dtype: d up = dy * act(g), d gate = (dy * up) * act'(g). `act_and_derivative` maps an
    accumulation-dtype chunk g to (act(g), act'(g)). Returns two [n, F] tensors in the inputs' dtypes."""
    acc = accumulate_dtype(gate.dtype)
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    for s, e in row_chunks(gate.shape[0], gate.shape[1]):
        dy = grad_y[s:e].to(acc)
        a, da = act_and_derivative(gate[s:e].to(acc))
        dup[s:e] = dy * a
        dgate[s:e] = (dy * up[s:e].to(acc)).mul_(da)
    return dgate, dup


def _silu(g: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    return sigmoid(g, kernels=kernels).mul_(g)


def _silu_and_derivative(g: Tensor, *, kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    s = sigmoid(g, kernels=kernels)
    gs = g * s
    # d silu / d g = s * (1 + g * (1 - s)) = s + gs * (1 - s)
    return gs, (1.0 - s).mul_(gs).add_(s)


class GatedMul(torch.autograd.Function):
    """act(gate) * up with its backward, chunk by chunk (gated_forward / gated_backward); silu_mul
    and gelu_mul pass their activation and its derivative, each taking the CPU kernels as its
    `kernels` keyword, and the kernels (None: PyTorch's)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, act: Callable[..., Tensor],
                act_and_derivative: Callable[..., tuple[Tensor, Tensor]], kernels: CpuKernels | None) -> Tensor:
        ctx.save_for_backward(gate, up)
        ctx.act_and_derivative, ctx.kernels = act_and_derivative, kernels
        return gated_forward(functools.partial(act, kernels=kernels), gate, up)

    @staticmethod
    @first_order_only("silu_mul / gelu_mul")
    def backward(ctx, grad_y: Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = gated_backward(functools.partial(ctx.act_and_derivative, kernels=ctx.kernels), gate, up,
                                    grad_y.contiguous())
        return dgate, dup, None, None, None


@register("portable", "silu_mul")
def silu_mul(gate: Tensor, up: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """The portable silu_mul, its exp on the CPU kernels `kernels` (None: PyTorch's)."""
    return GatedMul.apply(gate.contiguous(), up.contiguous(), _silu, _silu_and_derivative, kernels)
