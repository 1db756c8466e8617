"""Triton silu_mul and rope: elementwise, so any layout gives the same bits per element."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import register
from ..portable.rope import rope_cos_sin
from ._common import acc_dtype, cast_out

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
        cos, sin = rope_cos_sin(positions, x.shape[-1], theta, scaling, acc_dtype(x.dtype))
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.style = style
        return _rope_launch(x, cos, sin, 1.0, style)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rope_launch(g.contiguous(), cos, sin, -1.0, ctx.style), None, None, None, None


@register("triton", "rope")
def rope(x, positions, theta, style, scaling):
    return _Rope.apply(x.contiguous(), positions, theta, style, scaling)


@triton.jit(do_not_specialize=["D"])
def embedding_fwd_kernel(ids_ptr, w_ptr, y_ptr, D, BLOCK: tl.constexpr):
    """Program t copies row ids[t] of the table."""
    t = tl.program_id(0)
    row = tl.load(ids_ptr + t)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        tl.store(y_ptr + t * D + cols, tl.load(w_ptr + row * D + cols, mask=cols < D), mask=cols < D)


@triton.jit(do_not_specialize=["D"])
def embedding_bwd_kernel(order_ptr, starts_ptr, counts_ptr, uids_ptr, g_ptr, dw_ptr, D, BLOCK: tl.constexpr):
    """Program u: dW[uids[u]] = the gradient rows of that id's occurrences, added in position order."""
    u = tl.program_id(0)
    start = tl.load(starts_ptr + u)
    count = tl.load(counts_ptr + u)
    row = tl.load(uids_ptr + u)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(0, count):
            t = tl.load(order_ptr + start + j)
            acc += tl.load(g_ptr + t * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(dw_ptr + row * D + cols, acc, mask=cols < D)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        t, d = ids.numel(), weight.shape[1]
        y = torch.empty((t, d), dtype=weight.dtype, device=weight.device)
        if t:
            embedding_fwd_kernel[(t,)](ids, weight, y, d, BLOCK=min(1024, triton.next_power_of_2(d)))
        ctx.save_for_backward(ids)
        ctx.shape = weight.shape
        return y

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        v, d = ctx.shape
        dw = torch.zeros((v, d), dtype=acc_dtype(g.dtype), device=g.device)
        if ids.numel():
            order = torch.argsort(ids, stable=True)
            uids, counts = torch.unique_consecutive(ids[order], return_counts=True)
            starts = torch.cumsum(counts, 0) - counts
            embedding_bwd_kernel[(uids.numel(),)](order, starts, counts, uids, g.contiguous(), dw, d,
                                                  BLOCK=min(1024, triton.next_power_of_2(d)))
        return None, dw.to(g.dtype)


@register("triton", "embedding")
def embedding(ids, weight):
    return _Embedding.apply(ids.contiguous(), weight.contiguous())
