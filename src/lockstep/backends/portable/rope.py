"""Portable rope: angles from float64 position x frequency, rotation in fp32."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics.fixed_order import accumulate_dtype
from ...registry import register
from ...rotary import rope_cos_sin


def _halves(x: Tensor, style: str) -> tuple[Tensor, Tensor]:
    if style == "neox":
        half = x.shape[-1] // 2
        return x[..., :half], x[..., half:]
    return x[..., 0::2], x[..., 1::2]


def _join(a: Tensor, b: Tensor, style: str) -> Tensor:
    if style == "neox":
        return torch.cat([a, b], dim=-1)
    return torch.stack([a, b], dim=-1).flatten(-2)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    x1, x2 = _halves(x, style)
    return _join(x1 * cos - x2 * sin, x2 * cos + x1 * sin, style)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, positions: Tensor, theta: float, style: str, scaling) -> Tensor:
        acc = accumulate_dtype(x.dtype)
        cos, sin = rope_cos_sin(positions, x.shape[-1], theta, scaling, acc)
        ctx.save_for_backward(cos, sin)
        ctx.style = style
        return _rotate(x.to(acc), cos, sin, style).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        cos, sin = ctx.saved_tensors
        g = grad_y.contiguous()
        # The transpose of a rotation is the rotation by the opposite angle.
        return _rotate(g.to(cos.dtype), cos, -sin, ctx.style).to(g.dtype), None, None, None, None


@register("portable", "rope")
def rope(x: Tensor, positions: Tensor, theta: float, style: str, scaling) -> Tensor:
    return _Rope.apply(x.contiguous(), positions, theta, style, scaling)
