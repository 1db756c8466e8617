"""Row-invariant GEMMs: the row dimension cut into fixed-shape tiles, so the BLAS sees the same
problem shapes whatever the batch size (docs/adr/0001-fixed-tiles-and-reduction-order.md), or the
GEMM of the CPU kernels passed in (`cpu_kernels`), one reduction order on every CPU. Also the probe
of which premises of that invariance PyTorch's fp32 GEMM breaks on this machine (docs/contract.md,
section 7)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from .cpu_kernels import CpuKernels, kernels_for
from .tiles import COLUMN_CHUNK, ROW_TILE, TAIL_TILE, TAIL_TILES, tail_tiles
from .tree import split_sum

def matmul_rows(a: Tensor, b: Tensor, bias: Tensor | None = None, *, kernels: CpuKernels | None = None) -> Tensor:
    """a @ b (+ bias), row-invariant: a [M, K], b [K, N] (may be a transposed view), bias [N];
    or batched: a [B, M, K], b [B, K, N]. Returns [(B,) M, N] in a's dtype. On the CPU kernels
    `kernels` where they take `a`, else (and for None) by `torch_matmul_rows`."""
    taken = kernels_for(kernels, a, float64=True)
    if taken is not None:
        return taken.matmul_rows(a, b, bias)
    return torch_matmul_rows(a, b, bias)


def torch_matmul_rows(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a @ b (+ bias) through PyTorch's GEMMs, row-invariant: a [M, K], b [K, N] (may be a transposed view), bias [N];
    or batched: a [B, M, K], b [B, K, N].

    The rows of `a` are processed in tiles of exactly ROW_TILE rows, the tail in the `tail_tiles`
    shapes, largest first; rows that fill more than 3/4 of a tile (or fewer than the smallest) are
    zero-padded to it. In fp32 on a CPU the columns go in COLUMN_CHUNK-column calls. So each BLAS
    call has one of a few fixed shapes and a row's result never depends on M or on its position.
    bf16 runs natively (fp32 accumulation in oneDNN);
    fp16 is computed in fp32 because CPUs without fp16 arithmetic are faster and exact that way.
    The bias is added inside the GEMM (addmm) so the result is rounded once. Returns [(B,) M, N]
    in a's dtype.
    """
    out_dtype = a.dtype
    if a.dtype == torch.float16 and a.device.type == "cpu":
        a, b = a.float(), b.float()
        bias = None if bias is None else bias.float()
    batched = a.dim() == 3
    n = b.shape[-1]
    # fp32 CPU GEMMs with many columns run in COLUMN_CHUNK-column calls, where MKL's fp32 kernels are
    # faster (bf16's are not; docs/benchmarks.md). The bits are those of one call.
    columns = COLUMN_CHUNK if a.dtype == torch.float32 and a.device.type == "cpu" and not batched else n

    def gemm(rows: Tensor, out: Tensor | None = None) -> Tensor:
        if batched:
            return torch.bmm(rows, b, out=out)
        if out is None:
            out = rows.new_empty((rows.shape[0], n))
        for c in range(0, max(n, 1), columns):
            e = min(n, c + columns)
            if bias is None:
                torch.mm(rows, b[:, c:e], out=out[:, c:e])
            else:
                torch.addmm(bias[c:e], rows, b[:, c:e], out=out[:, c:e])
        return out

    a = a.contiguous()
    m, k = a.shape[-2], a.shape[-1]
    lead = a.shape[:-2]
    out = a.new_empty(lead + (m, b.shape[-1]))
    # Every tile computes in a's dtype: autocast would cast the tiles called without `out=` (the
    # padded ones) and not the others, so a row's bits would depend on its tile. The ops decide the
    # dtype under autocast before they get here.
    tails = tail_tiles(a.dtype, a.device)
    with torch.autocast(a.device.type, enabled=False):
        start = 0
        while start < m:
            rest = m - start
            tile = next((t for t in (ROW_TILE,) + tails if rest >= t or 4 * rest > 3 * t), tails[-1])
            if rest >= tile:
                gemm(a[..., start:start + tile, :], out=out[..., start:start + tile, :])
                start += tile
            else:
                padded = a.new_zeros(lead + (tile, k))
                padded[..., :rest, :] = a[..., start:, :]
                out[..., start:, :] = gemm(padded)[..., :rest, :]
                start = m
    return out.to(out_dtype)


def split_matmul_rows(a: Tensor, b: Tensor, parts: int, *, kernels: CpuKernels | None = None) -> Tensor:
    """a @ b with the reduction over K cut into `parts` slices (`split_sum` of `matmul_rows`): a
    [M, K], b [K, N] (a transposed view is free) -> [M, N] in a's dtype, each slice's product
    rounded to it and the slices summed by the canonical tree in it. On the CPU kernels `kernels`
    (None: PyTorch's), which may do this in one call, with these bits."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a, b: expected [M, K] and [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if parts == 1:
        return matmul_rows(a, b, kernels=kernels)
    taken = kernels_for(kernels, a)
    if taken is not None and taken.split_matmul_rows is not None:
        return taken.split_matmul_rows(a, b, parts)
    return split_sum(lambda s, e: matmul_rows(a[:, s:e], b[s:e], kernels=kernels), a.shape[-1], parts)


def torch_gemm_broken_premises() -> tuple[str, ...]:
    """Which premises of the portable backend's invariance PyTorch's fp32 CPU GEMM breaks at this
    thread count (docs/contract.md, section 7): "row tiles" where a row's bits differ between the
    row tiles `torch_matmul_rows` uses (batch invariance rests on it), "column widths" where a
    column's bits follow the call's width (COLUMN_CHUNK's calls and tensor-parallel shards rest on
    it). MKL on an Intel CPU without AVX-512 breaks both, and on a 2-core AVX-512 Xeon at 2 threads
    the row tiles (ADR 0026). A probe of a few shapes, called as linear calls them (the weight a
    transposed view): a premise it names broken is broken; one it passes is what `lockstep check
    --backend portable` and tests/test_portable.py test further."""
    return _gemm_broken_premises(torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _gemm_broken_premises(threads: int) -> tuple[str, ...]:
    return gemm_broken_premises(torch.mm)


def gemm_broken_premises(mm: Callable[[Tensor, Tensor], Tensor]) -> tuple[str, ...]:
    """`torch_gemm_broken_premises`'s probe of a given fp32 GEMM mm(a [M, K], b [K, N]) -> [M, N],
    at the current thread count: so a test can ask what the probe should see of an arithmetic it
    spells out."""
    gen = torch.Generator().manual_seed(0)

    def products(m: int, k: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
        a, b = torch.randn(m, k, generator=gen), (torch.randn(n, k, generator=gen) / 32).t()
        return a, b, mm(a, b)

    rows = columns = True
    # The probe may first run inside an op under autocast; its answer is about fp32 GEMMs.
    with torch.autocast("cpu", enabled=False):
        for k, n in ((300, 77), (1024, 1024)):
            a, b, full = products(ROW_TILE, k, n)
            rows = rows and all(torch.equal(mm(a[:t], b), full[:t]) for t in TAIL_TILES)
        for k, n in ((300, 77), (1024, COLUMN_CHUNK + 1904)):
            a, b, full = products(TAIL_TILE, k, n)
            parts = [(0, n // 2), (n // 2, n)] + ([(0, COLUMN_CHUNK), (COLUMN_CHUNK, n)] if n > COLUMN_CHUNK else [])
            columns = columns and all(torch.equal(mm(a, b[:, lo:hi]), full[:, lo:hi]) for lo, hi in parts)
    return tuple(name for name, kept in (("row tiles", rows), ("column widths", columns)) if not kept)
