"""Triton rope: one program per token rotates each head by that token's own angles (float64
position x frequency, from lockstep.rotary, as every backend)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.fixed_order import accumulate_dtype
from ...registry import register
from ...rotary import rope_cos_sin
from ...numerics.second_order import first_order_only
from .common import cast_out


@triton.jit(do_not_specialize=["H", "HALF"])
def rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, HALF, SIGN: tl.constexpr, GPTJ: tl.constexpr,
                BLOCK: tl.constexpr):
    """Program t rotates every head of token t by its own cos/sin row ([HALF] each)."""
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    c = tl.load(cos_ptr + t * HALF + i, mask=m, other=0.0)
    s = tl.load(sin_ptr + t * HALF + i, mask=m, other=0.0) * SIGN
    for h in range(0, H):
        base = (t * H + h) * 2 * HALF
        if GPTJ:
            i1 = 2 * i
            i2 = 2 * i + 1
        else:
            i1 = i
            i2 = i + HALF
        x1 = tl.load(x_ptr + base + i1, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + base + i2, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + base + i1, cast_out((x1 * c - x2 * s), y_ptr), mask=m)
        tl.store(y_ptr + base + i2, cast_out((x2 * c + x1 * s), y_ptr), mask=m)


def _rope_launch(x, cos, sin, sign, style):
    t, h, d = x.shape
    y = torch.empty_like(x)
    if t:
        rope_kernel[(t,)](x, cos, sin, y, h, d // 2, SIGN=sign, GPTJ=style == "gptj",
                          BLOCK=triton.next_power_of_2(d // 2))
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, theta, style, scaling):
        cos, sin = rope_cos_sin(positions, x.shape[-1], theta, scaling, accumulate_dtype(x.dtype))
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.style = style
        return _rope_launch(x, cos, sin, 1.0, style)

    @staticmethod
    @first_order_only("rope")
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rope_launch(g.contiguous(), cos, sin, -1.0, ctx.style), None, None, None, None


@register("triton", "rope")
def rope(x, positions, theta, style, scaling):
    return _Rope.apply(x.contiguous(), positions, theta, style, scaling)
