"""Guards for what the portable backend assumes of the machine's PyTorch build.

If one of these fails on a platform, the portable backend's invariance does not hold there, and
this test says which primitive broke it. The GEMM's premises (a row's bits the same in every row
tile, a column's at every width) are probed by the library too (fixed_order.
torch_gemm_broken_premises), which says so where they break (MKL on an Intel CPU: both without
AVX-512, the row tiles on a 2-core AVX-512 Xeon at 2 threads; contract section 7): there a guard
of that premise fails unless the probe named it, and is then reported as an expected failure with
the premise named. The GEMM guards run on 2 threads.
"""

import pytest
import torch

from lockstep.numerics.fixed_order import (ROW_TILE, column_sum, matmul_rows, row_sum, tail_tiles,
                                           torch_gemm_broken_premises)
from lockstep.harness.check import num_threads

PRIMITIVES = {
    "exp": (torch.exp, 30.0),
    "log": (torch.log, None),
    "sin": (torch.sin, 1e4),
    "cos": (torch.cos, 1e4),
    "rsqrt": (torch.rsqrt, None),
    "reciprocal": (torch.reciprocal, None),
}


def require_same(same: bool, premise: str | None, what: object) -> None:
    """A GEMM guard's check: where it fails and the library's probe names `premise` (an fp32 one)
    broken, the contract promises nothing that rests on it (section 7): an expected failure."""
    if not same and premise is not None and premise in torch_gemm_broken_premises():
        pytest.xfail(f"this machine's fp32 GEMM breaks the portable backend's {premise} premise, as "
                     "fixed_order.torch_gemm_broken_premises says (contract section 7)")
    assert same, what


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(PRIMITIVES))
def test_primitive_same_bits_in_vector_and_scalar_paths(name, dtype):
    fn, scale = PRIMITIVES[name]
    gen = torch.Generator().manual_seed(0)
    n = 1 << 20
    x = torch.randn(2 * n, generator=gen, dtype=dtype) * scale if scale else torch.rand(2 * n, generator=gen, dtype=dtype) * 100
    strided = fn(x[::2])               # TensorIterator's scalar loop
    contiguous = fn(x[::2].contiguous())  # vectorised loop with a scalar tail
    assert torch.equal(strided, contiguous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemm_row_tiles_agree_with_tail_tiles(dtype):
    """At one thread count. Across thread counts the portable backend promises nothing (contract
    section 7, thread_invariant = false): MKL on a Xeon re-blocks with them, and
    LOCKSTEP_TEST_REBLOCKING_BLAS=threads shows it here (docs/adr/0024)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2 * ROW_TILE + 45, 300, generator=gen).to(dtype)
    b = (torch.randn(300, 77, generator=gen) / 17).to(dtype)
    with num_threads(2):
        alone = torch.cat([matmul_rows(a[i:i + 1], b) for i in range(a.shape[0])])     # the smallest tile, padded
        # Row counts that run every tile shape after a full one, and padded ones: 13 -> 16, 50 -> 64,
        # 100 -> 128, 5 -> 8 (fp32; 4 + 4 in bf16), 3 -> 4 (bf16), and all rows (128 + 128 + 32 + 16 padded).
        for m in [ROW_TILE + t for t in tail_tiles(dtype, a.device)] + [13, 50, 100, 5, 3, a.shape[0]]:
            same = torch.equal(matmul_rows(a[:m], b), alone[:m])
            require_same(same, "row tiles" if dtype == torch.float32 else None, m)


def test_row_sum_order_depends_only_on_length():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 70001, generator=gen)
    full = row_sum(x)
    assert torch.equal(row_sum(x[4:5])[0], full[4])
    assert torch.equal(row_sum(x[:, :70001].t().contiguous().t()), full)
    torch.testing.assert_close(full.double(), x.double().sum(-1), atol=1e-3, rtol=1e-5)


def test_column_sum_appended_zero_rows_change_nothing():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(301, 33, generator=gen)
    assert torch.equal(column_sum(torch.cat([x, torch.zeros(200, 33)])), column_sum(x))
    torch.testing.assert_close(column_sum(x).double(), x.double().sum(0), atol=1e-4, rtol=1e-5)


def test_gemm_row_tiles_agree_under_autocast():
    """Tiles written through `out=` escape autocast and padded ones do not; matmul_rows turns
    autocast off so that every tile computes in the input's dtype."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(ROW_TILE + 64, 64, generator=gen), torch.randn(64, 48, generator=gen)
    with num_threads(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            alone = torch.cat([matmul_rows(a[i:i + 1], b) for i in range(a.shape[0])])
            for m in (5, 100, ROW_TILE + 64):
                require_same(torch.equal(matmul_rows(a[:m], b), alone[:m]), "row tiles", m)
        require_same(torch.equal(matmul_rows(a, b), alone), "row tiles", "outside autocast")


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_a_gemm_column_has_the_same_bits_in_a_call_of_any_width(rows, monkeypatch):
    """matmul_rows cuts fp32 columns into COLUMN_CHUNK-column calls, and a column-parallel linear
    shard is a call with fewer columns: both need a column's bits to be independent of N."""
    from lockstep.numerics import fixed_order

    gen = torch.Generator().manual_seed(1)
    a = torch.randn(rows, 1024, generator=gen)
    w = torch.randn(10_000, 1024, generator=gen) / 32
    bias = torch.randn(10_000, generator=gen)
    with num_threads(2):
        chunked = matmul_rows(a, w.t(), bias)
        monkeypatch.setattr(fixed_order, "COLUMN_CHUNK", 1 << 30)
        whole = matmul_rows(a, w.t(), bias)
        require_same(torch.equal(chunked, whole), "column widths", "COLUMN_CHUNK's calls")
        shard = matmul_rows(a, w[1000:3000].t(), bias[1000:3000])
        require_same(torch.equal(whole[:, 1000:3000], shard), "column widths", "a shard")
