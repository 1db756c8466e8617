"""The one GEMM of the Triton backend: C (+)= A @ B (+ bias), every output tile reducing the whole K
in BLOCK_K steps from k = 0, in order. No split-K, no atomics, one tile configuration per dtype.

linear's forward, dX and dW all use it (dW as dY^T @ X, so the reduction over rows runs in
fixed BLOCK_K-row steps from row 0 and zero-gradient padding rows add exact zeros)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...fixed_order import accumulate_dtype
from .common import cast_out, dot_acc, dot_precision, gemm_config

SIZE_ARGS = ["M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn"]


@triton.jit
def _offsets(rows, cols, stride_r, stride_c, UNIT: tl.constexpr):
    """Element offsets of a [rows, cols] tile. UNIT names the axis whose stride is 1 ("rows",
    "cols" or "none"): a layout, known before launch, that lets the compiler vectorize the loads,
    where a runtime stride of 1 would have to be specialized on its value."""
    if UNIT == "cols":
        return rows[:, None] * stride_r + cols[None, :]
    elif UNIT == "rows":
        return rows[:, None] + cols[None, :] * stride_c
    else:
        return rows[:, None] * stride_r + cols[None, :] * stride_c


def unit_axis(t: torch.Tensor) -> str:
    """Which axis of the 2-D tensor t has stride 1 (see `_offsets`)."""
    if t.stride(1) == 1:
        return "cols"
    return "rows" if t.stride(0) == 1 else "none"


@triton.jit(do_not_specialize=SIZE_ARGS)
def gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                stride_cn, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
                A_UNIT: tl.constexpr, B_UNIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """One program computes the BLOCK_M x BLOCK_N tile (pid_m, pid_n) of C, over all of K."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + _offsets(rm, kk, stride_am, stride_ak, A_UNIT),
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + _offsets(kk, rn, stride_bk, stride_bn, B_UNIT),
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = dot_acc(a, b, acc, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, cast_out(acc, c_ptr), mask=c_mask)


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         accumulate: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]); any strides. With accumulate, adds into `out`."""
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or a.dtype, device=a.device)
    cfg = gemm_config(a.dtype)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    gemm_kernel[grid](a, b, out, bias if bias is not None else out, m, n, k, a.stride(0), a.stride(1), b.stride(0),
                      b.stride(1), out.stride(0), out.stride(1), HAS_BIAS=bias is not None, ACCUMULATE=accumulate,
                      PRECISION=dot_precision(a.dtype), A_UNIT=unit_axis(a), B_UNIT=unit_axis(b),
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
    return out


def weight_grad(grad_out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """sum over rows of grad_out[r]^T inp[r]: [M, N], [M, K] -> [N, K] in fp32, rows in fixed order."""
    acc = accumulate_dtype(grad_out.dtype)
    return gemm(grad_out.t(), inp.to(grad_out.dtype), out_dtype=acc)
