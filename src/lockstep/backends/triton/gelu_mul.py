"""Triton gelu_mul: elementwise in fixed BLOCK-element programs, so any layout gives the same bits
per element. The tanh GELU is evaluated as g * sigmoid(2u), as the portable kernel does."""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ...registry import register
from .common import cast_out, gated_function

C1 = 2.0 * math.sqrt(2.0 / math.pi)          # d(2u)/dg at g = 0
C3 = C1 * 0.044715


@triton.jit(do_not_specialize=["n"])
def gelu_mul_fwd_kernel(g_ptr, u_ptr, y_ptr, n, C1: tl.constexpr, C3: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: elements [p * BLOCK, (p + 1) * BLOCK) of gelu_tanh(gate) * up, in fp32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-((g * g * C3 + C1) * g)))
    tl.store(y_ptr + offs, cast_out(((s * g) * u), y_ptr), mask=m)


@triton.jit(do_not_specialize=["n"])
def gelu_mul_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n, C1: tl.constexpr, C3: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program p: gradients of elements [p * BLOCK, (p + 1) * BLOCK)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    two_u = (g * g * C3 + C1) * g
    s = 1.0 / (1.0 + tl.exp(-two_u))
    s_complement = 1.0 / (1.0 + tl.exp(two_u))     # 1 - s without the cancellation (portable's reason)
    gelu = g * s
    d2u = g * g * (3.0 * C3) + C1
    tl.store(du_ptr + offs, cast_out((dy * gelu), du_ptr), mask=m)
    tl.store(dg_ptr + offs, cast_out(((dy * u) * (s_complement * gelu * d2u + s)), dg_ptr), mask=m)


_GeluMul = gated_function(gelu_mul_fwd_kernel, gelu_mul_bwd_kernel, C1=C1, C3=C3)


@register("triton", "gelu_mul")
def gelu_mul(gate, up):
    return _GeluMul.apply(gate.contiguous(), up.contiguous())
