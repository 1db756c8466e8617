"""The fixed shapes every reduction order is built from: row tiles of the GEMMs, the lanes of a row
sum, the row blocks of weight gradients, attention's key blocks and the parts of a reduction that
tensor parallelism may shard. A row's bits depend on these and on the reduced length alone."""

from __future__ import annotations

import torch

# Rows per GEMM call in the bulk of a batch, and the tile shapes of the tail (the rows after the
# last full ROW_TILE, largest first; the last few rows zero-padded to TAIL_TILE). Every shape goes
# through the same M-blocked BLAS kernel, whose reduction order over K depends on K alone (ADR
# 0001); the small tiles keep decode (one row) from paying for a full 128-row tile, and a
# sequence-sized tail (127 rows) from taking sixteen 8-row calls. Below 4 rows MKL switches to a
# GEMV path with other bits, so every tile must stay >= 4 (tests/test_portable.py).
ROW_TILE = 128
TAIL_TILES = (64, 32, 16, 8)
TAIL_TILE = TAIL_TILES[-1]
# bf16 on a CPU adds a 4-row tile: oneDNN's bf16 GEMM gives 4 rows the bits of 128 and runs them
# at about GEMV speed, so decode's one row pays for 4, not 8. MKL's fp32 4-row tile is not faster
# than its 8-row one.
CPU_BF16_TAIL_TILES = TAIL_TILES + (4,)


def tail_tiles(dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """The tail tile shapes `matmul_rows` uses for a dtype on a device, largest first."""
    return CPU_BF16_TAIL_TILES if dtype == torch.bfloat16 and device.type == "cpu" else TAIL_TILES


# Width of the sequential stage of `row_sum`; the remaining WIDTH lanes are folded pairwise.
SUM_WIDTH = 512
# Rows per block in weight-gradient reductions.
ROW_BLOCK = 128
# Columns per GEMM call in fp32 on a CPU (matmul_rows), for speed. A column's bits do not depend on
# the call's N (tensor parallelism relies on it: a column-parallel shard is a call with fewer
# columns), so the chunks give the bits of one call (tests/test_portable.py).
COLUMN_CHUNK = 4096
# Keys per block of attention's online softmax; blocks are anchored at key 0 (ADR 0002).
KEY_BLOCK = 64
# The parts a reduction over a dimension that tensor parallelism may shard (a row-parallel linear's
# K, a column-parallel linear's N in backward, attention heads) is split into, at every
# tensor-parallel size: a TP rank computes a contiguous run of parts and the ranks complete the
# same tree (ADR 0007). Tensor-parallel sizes must divide it.
TP_SPLIT = 4


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for 16- and 32-bit floats; float64 passes through."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ceil_div(n: int, d: int) -> int:
    """The number of blocks of `d` that cover `n` (n >= 0, d > 0)."""
    return -(-n // d)
