"""Fixed-order column sums (two passes: partial sums of ROWS_PER_PARTIAL rows, then the partials in
order) for bias and norm-weight gradients, and for summing losses over rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.fixed_order import accumulate_dtype
from .common import ROWS_PER_PARTIAL


@triton.jit(do_not_specialize=["M", "N", "span"])
def partial_colsum_kernel(x_ptr, out_ptr, M, N, span, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (p, j): the sum of rows [p * span, (p + 1) * span) of column block j. Each tile of
    ROWS rows is summed as a tree (tl.sum over a fixed tile shape), and the tiles in order."""
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float64)
    end = tl.minimum(p * span + span, M)
    for r0 in range(p * span, end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        tile = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < end) & (cols[None, :] < N),
                       other=0.0)
        acc += tl.sum(tile.to(tl.float64), axis=0)
    tl.store(out_ptr + p * N + cols, acc, mask=cols < N)


def column_sum(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] -> [N] (fp32): partials of ROWS_PER_PARTIAL rows (tree-summed), then the partials in
    order. Appended zero rows add exact zeros."""
    x = x.contiguous()
    m, n = x.shape
    parts = max(1, triton.cdiv(m, ROWS_PER_PARTIAL))
    block = 64
    # float64 partials: these sums (bias, norm weights, losses) are small, and fp32 tiles summed as
    # trees lose up to a few ulp where eager PyTorch loses half of one.
    partial = torch.empty((parts, n), dtype=torch.float64, device=x.device)
    partial_colsum_kernel[(parts, triton.cdiv(n, block))](x, partial, m, n, ROWS_PER_PARTIAL, ROWS=ROWS_PER_PARTIAL,
                                                          BLOCK_N=block)
    if parts == 1:
        return partial[0].to(accumulate_dtype(x.dtype))
    out = torch.empty((1, n), dtype=partial.dtype, device=x.device)
    partial_colsum_kernel[(1, triton.cdiv(n, block))](partial, out, parts, n, parts, ROWS=ROWS_PER_PARTIAL,
                                                      BLOCK_N=block)
    return out[0].to(accumulate_dtype(x.dtype))
