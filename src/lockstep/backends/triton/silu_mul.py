"""Triton silu_mul: elementwise in fixed BLOCK-element programs, so any layout gives the same bits
per element."""

from __future__ import annotations

import triton
import triton.language as tl

from ...registry import register
from .common import cast_out, gated_function

@triton.jit(do_not_specialize=["n"])
def silu_mul_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """Program p: elements [p * BLOCK, (p + 1) * BLOCK) of silu(gate) * up, in fp32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(y_ptr + offs, cast_out(((g * s) * u), y_ptr), mask=m)


@triton.jit(do_not_specialize=["n"])
def silu_mul_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    """Program p: gradients of elements [p * BLOCK, (p + 1) * BLOCK)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    gs = g * s
    tl.store(du_ptr + offs, cast_out((dy * gs), du_ptr), mask=m)
    tl.store(dg_ptr + offs, cast_out(((dy * u) * (s + gs * (1.0 - s))), dg_ptr), mask=m)


_SiluMul = gated_function(silu_mul_fwd_kernel, silu_mul_bwd_kernel)


@register("triton", "silu_mul")
def silu_mul(gate, up):
    return _SiluMul.apply(gate.contiguous(), up.contiguous())
