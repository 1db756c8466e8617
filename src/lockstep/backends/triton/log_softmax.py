"""Triton log_softmax: one program per row; the row's log-sum-exp over fixed BLOCK-lane steps from
column 0 (`row_lse`), then y = x - lse."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.fixed_order import accumulate_dtype
from ...registry import register
from .common import cast_out, kernel_function, lane_block, launch, row_lse


@triton.jit(do_not_specialize=["V"])
def log_softmax_fwd_kernel(x_ptr, y_ptr, lse_ptr, V, BLOCK: tl.constexpr):
    """Program r: row r's log-sum-exp, then y = x - lse."""
    row = tl.program_id(0)
    lse = row_lse(x_ptr + row * V, V, 1.0, BLOCK)
    tl.store(lse_ptr + row, lse)
    lanes = tl.arange(0, BLOCK)
    for v0 in range(0, V, BLOCK):
        m = v0 + lanes < V
        x = tl.load(x_ptr + row * V + v0 + lanes, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * V + v0 + lanes, cast_out((x - lse), y_ptr), mask=m)


@triton.jit(do_not_specialize=["V"])
def log_softmax_bwd_kernel(x_ptr, lse_ptr, g_ptr, dx_ptr, V, BLOCK: tl.constexpr):
    """Program r: dx = g - softmax * sum(g), sum(g) in BLOCK-lane steps."""
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        acc += tl.load(g_ptr + row * V + v0 + lanes, mask=v0 + lanes < V, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    lse = tl.load(lse_ptr + row)
    for v0 in range(0, V, BLOCK):
        m = v0 + lanes < V
        x = tl.load(x_ptr + row * V + v0 + lanes, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * V + v0 + lanes, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * V + v0 + lanes, cast_out((g - tl.exp(x - lse) * total), dx_ptr), mask=m)


def _forward(x):
    m, v = x.shape
    y = torch.empty_like(x)
    lse = torch.empty(m, dtype=accumulate_dtype(x.dtype), device=x.device)
    launch(log_softmax_fwd_kernel, m, x, y, lse, v, BLOCK=lane_block(v))
    return y, (x, lse)


def _backward(saved, g):
    x, lse = saved
    dx = torch.empty_like(x)
    launch(log_softmax_bwd_kernel, x.shape[0], x, lse, g, dx, x.shape[1], BLOCK=lane_block(x.shape[1]))
    return dx


_LogSoftmax = kernel_function("log_softmax", _forward, _backward)


@register("triton", "log_softmax")
def log_softmax(x):
    return _LogSoftmax.apply(x.contiguous())
