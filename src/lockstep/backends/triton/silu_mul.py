"""Triton silu_mul: elementwise in fixed BLOCK-element programs, so any layout gives the same bits
per element."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...registry import register
from .common import cast_out

BLOCK = 1024


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


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            silu_mul_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            silu_mul_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, dy.contiguous(), dg, du, n, BLOCK=BLOCK)
        return dg, du


@register("triton", "silu_mul")
def silu_mul(gate, up):
    return _SiluMul.apply(gate.contiguous(), up.contiguous())
