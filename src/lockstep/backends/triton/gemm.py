"""The one GEMM of the Triton backend: C (+)= A @ B (+ bias), every output tile reducing the whole K
in BLOCK_K steps from k = 0, in order. No split-K, no atomics, one tile configuration per dtype.

linear's forward, dX and dW all use it (dW as dY^T @ X, so the reduction over rows runs in
fixed BLOCK_K-row steps from row 0 and zero-gradient padding rows add exact zeros)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.fixed_order import accumulate_dtype
from .common import GemmConfig, cast_out, dot_acc, dot_precision, gemm_config

# M and K are batch sizes in some of linear's three GEMMs (M in the forward and dX, K in dW), so
# no size is specialized (docs/contract.md, section 6). Strides are: Triton specializes an integer
# argument on being 1 and on divisibility by 16, which is what lets it issue 16-byte, pipelined
# (cp.async) loads. A stride depends on the layout and the feature sizes, not on the row count, and
# the loads it specializes do not change any product or the order of any sum.
SIZE_ARGS = ["M", "N", "K"]


def even(size: int, block: int, unit_stride: bool) -> bool:
    """Whether the rows (or columns) past `size` need no clamping because size is a whole number of
    blocks. Asked only of an axis with unit stride, where clamping would stop the loads from being
    vectors along it: that axis is a feature axis in linear's GEMMs (A's in dW, B's in dX and dW),
    never a batch axis, so the answer does not change with the number of rows."""
    return unit_stride and size % block == 0


@triton.jit
def gemm_tile(a_ptr, b_ptr, c_ptr, bias_ptr, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
              stride_cm, stride_cn, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """The BLOCK_M x BLOCK_N tile (pid_m, pid_n) of C, over all of K.

    The K steps run in order from k = 0: the whole BLOCK_K steps unmasked (so that Triton pipelines
    their loads), then at most one masked step for the rest, whose missing products are exact zeros.
    Rows past M and columns past N load row or column 0 instead of being masked; their outputs are
    never stored, and no output element reads another row's or column's operands. EVEN_M (EVEN_N)
    leaves the rows (columns) unclamped when M (N) is a whole number of tiles (see `even`)."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_in = rm if EVEN_M else tl.where(rm < M, rm, 0)
    rn_in = rn if EVEN_N else tl.where(rn < N, rn, 0)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm_in[:, None] * stride_am
    b_cols = b_ptr + rn_in[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_whole = K - K % BLOCK_K
    for k0 in range(0, k_whole, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :] * stride_ak)
        b = tl.load(b_cols + kk[:, None] * stride_bk)
        acc = dot_acc(a, b, acc, PRECISION)
    if k_whole < K:
        kk = k_whole + rk
        a = tl.load(a_rows + kk[None, :] * stride_ak, mask=kk[None, :] < K, other=0.0)
        b = tl.load(b_cols + kk[:, None] * stride_bk, mask=kk[:, None] < K, other=0.0)
        acc = dot_acc(a, b, acc, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, cast_out(acc, c_ptr), mask=c_mask)


@triton.jit(do_not_specialize=SIZE_ARGS)
def gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                stride_cn, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
                EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Program (pid_m, pid_n) computes tile (pid_m, pid_n) of C (gemm_tile)."""
    gemm_tile(a_ptr, b_ptr, c_ptr, bias_ptr, tl.program_id(0), tl.program_id(1), M, N, K, stride_am, stride_ak,
              stride_bk, stride_bn, stride_cm, stride_cn, HAS_BIAS, ACCUMULATE, PRECISION, EVEN_M, EVEN_N, BLOCK_M,
              BLOCK_N, BLOCK_K)


@triton.jit(do_not_specialize=["M", "N0", "N1", "N2", "K", "T0", "T1"])
def gemm_group_kernel(a_ptr, b0_ptr, c0_ptr, bias0_ptr, N0, b1_ptr, c1_ptr, bias1_ptr, N1, b2_ptr, c2_ptr, bias2_ptr,
                      N2, M, K, T0, T1, stride_am, stride_ak, stride_bk, stride_bn, HAS_BIAS: tl.constexpr,
                      PRECISION: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Up to three products of one A [M, K], each B_j [K, N_j] of the same strides into its own
    contiguous C_j [M, N_j], all with a bias or none: the column tiles of product 0 are programs
    [0, T0) along axis 1, of product 1 [T0, T0 + T1), of product 2 the rest. Each tile is
    gemm_kernel's tile of its product."""
    pid = tl.program_id(1)
    b_ptr, c_ptr, bias_ptr, n, pid_n = b0_ptr, c0_ptr, bias0_ptr, N0, pid
    if pid >= T0 + T1:
        b_ptr, c_ptr, bias_ptr, n, pid_n = b2_ptr, c2_ptr, bias2_ptr, N2, pid - T0 - T1
    elif pid >= T0:
        b_ptr, c_ptr, bias_ptr, n, pid_n = b1_ptr, c1_ptr, bias1_ptr, N1, pid - T0
    gemm_tile(a_ptr, b_ptr, c_ptr, bias_ptr, tl.program_id(0), pid_n, M, n, K, stride_am, stride_ak, stride_bk,
              stride_bn, n, 1, HAS_BIAS, False, PRECISION, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K)


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         accumulate: bool = False, out_dtype: torch.dtype | None = None,
         config: GemmConfig | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]); any strides. With accumulate, adds into `out`. `config`
    replaces the dtype's tile configuration (benchmarks/bench_gemm_tiles.py compares candidates);
    another BLOCK_K gives other bits."""
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or a.dtype, device=a.device)
    cfg = config or gemm_config(a.dtype)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    gemm_kernel[grid](a, b, out, bias if bias is not None else out, m, n, k, a.stride(0), a.stride(1), b.stride(0),
                      b.stride(1), out.stride(0), out.stride(1), HAS_BIAS=bias is not None, ACCUMULATE=accumulate,
                      PRECISION=dot_precision(a.dtype), EVEN_M=even(m, cfg.block_m, a.stride(0) == 1),
                      EVEN_N=even(n, cfg.block_n, b.stride(1) == 1),
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
    return out


def weight_grad(grad_out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """sum over rows of grad_out[r]^T inp[r]: [M, N], [M, K] -> [N, K] in fp32, rows in fixed order."""
    acc = accumulate_dtype(grad_out.dtype)
    return gemm(grad_out.t(), inp.to(grad_out.dtype), out_dtype=acc)


GROUP_MAX = 3


def gemm_group(a: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """[gemm(a, b, bias) for b, bias in zip(bs, biases)] in one launch (gemm_group_kernel): a [M, K];
    1 to GROUP_MAX b [K, N_j] of one dtype and the same strides; biases all [N_j] or all None. Each
    output [M, N_j] in a's dtype has the bits of its own gemm call: the same tiles, each over the
    whole K in the same steps."""
    if not 1 <= len(bs) <= GROUP_MAX or len(biases) != len(bs) or any(b.stride() != bs[0].stride() for b in bs) \
            or len({bias is None for bias in biases}) != 1:
        raise ValueError(f"gemm_group: expected 1 to {GROUP_MAX} products of one layout, all with a bias or none")
    m, k = a.shape
    outs = [torch.empty((m, b.shape[1]), dtype=a.dtype, device=a.device) for b in bs]
    cfg = gemm_config(a.dtype)
    tiles = [triton.cdiv(b.shape[1], cfg.block_n) for b in bs]
    if m == 0 or sum(tiles) == 0:
        return outs
    has_bias = biases[0] is not None
    groups = [(b, out, bias if has_bias else out, b.shape[1]) for b, out, bias in zip(bs, outs, biases)]
    # Products past the last are never reached (the grid ends before): they repeat the last.
    groups += [groups[-1]] * (GROUP_MAX - len(bs))
    tiles += [0] * (GROUP_MAX - len(bs))
    gemm_group_kernel[(triton.cdiv(m, cfg.block_m), sum(tiles))](
        a, *groups[0], *groups[1], *groups[2], m, k, tiles[0], tiles[1], a.stride(0), a.stride(1), bs[0].stride(0),
        bs[0].stride(1), HAS_BIAS=has_bias, PRECISION=dot_precision(a.dtype),
        EVEN_M=even(m, cfg.block_m, a.stride(0) == 1),
        EVEN_N=all(even(b.shape[1], cfg.block_n, b.stride(1) == 1) for b in bs),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return outs
