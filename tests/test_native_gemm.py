"""The native GEMMs (gemm.c, tiles.c, gemm.py): the documented orders of fp32, fp16 and bf16, the
same bits on every instruction set, thread count, row, column and item size, a long K in blocks, the
operand copies, rounding to bf16 in the kernel, and a split product and a unit tree's weight gradient
in one call with the compositions' bits."""

from __future__ import annotations

import itertools

import pytest
import torch

from lockstep import ops, registry
from lockstep.backends.portable import linear as portable_linear
from lockstep.backends.portable import selected_logprobs as portable_slp
from lockstep.backends.native import build, gemm
from lockstep.harness.check import num_threads

from _native_helpers import DTYPES, _bits, _fma32
from _native_helpers import isa, unfused  # noqa: F401  (fixtures)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1029, 4133], ids=lambda k: f"K={k}")
def test_gemm_bits_across_instruction_sets_threads_rows_and_tails(dtype, k, isa):
    """K = 1029 and 4133 leave a tail in every lane width (4133: rows of 8 KB or more, which the
    kernel runs in blocks of K); 37 x 301 outputs leave partial micro-tiles and items; big enough to
    run on several threads."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, k, generator=gen).to(dtype)
    b = torch.randn(301, k, generator=gen).to(dtype)
    bias = torch.randn(301, generator=gen)
    outs = []
    for name in build.supported_isas():
        isa(name)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(gemm.gemm_nt(a, b, bias))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # A row's and a column's bits do not depend on the others in the call.
    assert torch.equal(gemm.gemm_nt(a[5:6], b, bias), outs[0][5:6])
    assert torch.equal(gemm.gemm_nt(a, b[7:9], bias[7:9]), outs[0][:, 7:9])
    ref = a.double() @ b.double().t() + bias.double()
    assert (outs[0].double() - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 3), (torch.float16, 6)], ids=str)
def test_gemm_order_is_the_documented_one(dtype, rows):
    """kernels.c's order, restated in Python: 16 lanes over K, each one fp32 FMA chain from k = 0
    (emulated exactly in float64 then rounded, as an FMA rounds once), folded by the fixed tree
    (in vector form on AVX2 and AVX-512). fp16 operands are widened exactly first; more rows than
    one micro-tile. (bf16 has its own order: test_bf16_gemm_order_is_the_documented_one.)"""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(rows, 45, generator=gen).to(dtype)
    b = torch.randn(2, 45, generator=gen).to(dtype)
    got = gemm.gemm_nt(a, b)
    assert torch.equal(gemm.gemm_nt(a[:1], b)[0], got[0])
    for m in range(rows):
        for n in range(2):
            lanes = [torch.tensor(0.0)] * 16
            for k in range(45):
                j = k % 16
                lanes[j] = (lanes[j].double() + a[m, k].double() * b[n, k].double()).float()
            t = [lanes[j] + lanes[j + 8] for j in range(8)]
            u = [t[j] + t[j + 4] for j in range(4)]
            v = [u[j] + u[j + 2] for j in range(2)]
            assert torch.equal(got[m, n], v[0] + v[1]), (m, n)


@pytest.mark.parametrize("dtype, k", [(torch.float32, 2048 * 2 + 37), (torch.bfloat16, 4096 * 2 + 75)], ids=str)
def test_a_long_k_in_blocks_keeps_the_documented_order(dtype, k):
    """Rows of 8 KB or more run in blocks of K, each tile's lanes carried from block to block: the
    order's bits, restated in Python (fp32: lane k % 16 adds element k; bf16: lane j of chunk c adds
    element 32 c + 2 j + 1, then 32 c + 2 j), then the fold."""
    gen = torch.Generator().manual_seed(9)
    a, b = torch.randn(5, k, generator=gen).to(dtype), torch.randn(6, k, generator=gen).to(dtype)
    got = gemm.gemm_nt(a, b)
    width = 16 if dtype == torch.float32 else 32
    padded = -(-k // width) * width
    af = torch.nn.functional.pad(a.float(), (0, padded - k))[:, None, :].expand(5, 6, padded)
    bf = torch.nn.functional.pad(b.float(), (0, padded - k))[None, :, :].expand(5, 6, padded)
    lanes = torch.zeros(5, 6, 16)
    for c in range(0, padded, width):
        if dtype == torch.float32:
            lanes = _fma32(af[..., c:c + 16], bf[..., c:c + 16], lanes)
        else:
            for odd in (1, 0):
                idx = torch.arange(16) * 2 + c + odd
                lanes = _fma32(af[..., idx], bf[..., idx], lanes)
    t = lanes[..., :8] + lanes[..., 8:]
    u = t[..., :4] + t[..., 4:]
    v = u[..., :2] + u[..., 2:]
    assert torch.equal(got, v[..., 0] + v[..., 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_long_k_gives_the_same_bits_in_items_of_every_size(dtype):
    """A long K's outputs run in items of 128, 64 or 32 outputs a side, by the thread count and the
    shape (their lanes on the heap above 32): every size gives the bits of five-row products (32)."""
    gen = torch.Generator().manual_seed(10)
    k = 8192 // (2 if dtype == torch.bfloat16 else 4) * 2 + 75
    a, b = torch.randn(300, k, generator=gen).to(dtype), torch.randn(290, k, generator=gen).to(dtype)
    with num_threads(2):                                      # five rows on 2 threads: 32 a side
        pieces = torch.cat([gemm.gemm_nt(a[i:i + 5], b) for i in range(0, 300, 5)])
    for threads in (1, 2, 3):
        with num_threads(threads):
            assert torch.equal(gemm.gemm_nt(a, b), pieces), threads


@pytest.mark.parametrize("dtype, bits", [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)], ids=str)
def test_the_blocked_transpose_moves_every_bit_pattern(dtype, bits):
    """The kernels' transpose (vector tiles inside, element loops at the edges) on every bit pattern,
    NaN payloads and signalling NaNs included, at sizes around its 8- and 64-element blocks."""
    gen = torch.Generator().manual_seed(12)
    top = 2 ** (8 * torch.tensor([], dtype=bits).element_size() - 1)
    for rows, cols in ((2, 9), (7, 8), (8, 8), (9, 63), (64, 64), (65, 130), (200, 17)):
        raw = torch.randint(-top, top, (3, cols + 5, rows + 3), generator=gen, dtype=torch.int64).to(bits)
        for source in (raw[0, :cols, :rows], raw[:, 2:cols + 2, 1:rows + 1]):  # padded rows; a batch of them
            x = source.view(dtype).transpose(-1, -2)         # [(B,) rows, cols], unit stride along rows
            got = gemm._rows_contiguous(x)
            assert got.stride(-1) == 1 and torch.equal(got.view(bits), source.transpose(-1, -2)), (rows, cols)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_operands_in_another_layout_are_copied_element_for_element(dtype):
    """gemm_nt's copies into row-contiguous form (the kernels' blocked transpose for transposed
    matrices, torch's copy for anything else): the values, moved, whatever the shape and strides."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 131, 67, generator=gen).to(dtype)
    views = [x[0].t(), x.transpose(1, 2), x[:, ::2].transpose(1, 2), x[1].t()[5:70], x.permute(2, 0, 1)[:, 1],
             x[0, :1].t(), torch.randn(700, 500, generator=gen).to(dtype).t()]
    for v in views:
        got = gemm._rows_contiguous(v)
        assert got.stride(-1) == 1 or got.shape[-1] <= 1
        assert torch.equal(got, v), tuple(v.shape)


def test_a_large_operand_copy_reuses_the_last_calls_buffer_until_the_next_call():
    """A transposed copy of 64 MB or more takes the buffer the previous GEMM call's largest copy
    left, whatever that held, and gives the bits of a product on a fresh copy; a call without one
    lets the buffer go."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 1024, generator=gen).bfloat16()
    w1, w2 = (torch.randn(1024, 32_768, generator=gen).bfloat16() for _ in range(2))   # [K, N]: 64 MB
    y1 = gemm.matmul_rows(x, w1)                                # copies w1.T into a new buffer
    (kept,) = gemm._kept
    y2 = gemm.matmul_rows(x, w2)                                # into the same buffer
    assert gemm._kept[0].data_ptr() == kept.data_ptr()
    for y, w in ((y1, w1), (y2, w2)):
        assert torch.equal(y, gemm.gemm_nt(x, w.t().contiguous(), out_dtype=torch.bfloat16))
    assert gemm._kept == []                                     # that call made no copy
    gemm.matmul_rows(x, w1[:, :8])
    assert gemm._kept == []


def test_weight_grad_of_rows_appended_with_zero_gradient_is_unchanged():
    gen = torch.Generator().manual_seed(2)
    g, x = torch.randn(50, 33, generator=gen), torch.randn(50, 70, generator=gen)
    pad_g, pad_x = torch.cat([g, torch.zeros(13, 33)]), torch.cat([x, torch.randn(13, 70, generator=gen)])
    assert torch.equal(gemm.weight_grad(g, x), gemm.weight_grad(pad_g, pad_x))
    torch.testing.assert_close(gemm.weight_grad(g, x).double(), g.double().t() @ x.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ops_under_native_and_portable_agree_within_the_contract(dtype):
    """They need not agree bitwise (docs/contract.md); both are held to the float64 reference by
    the op tests. Here: native is the CPU default, and a linear layer on it differs from portable's
    at most by accumulation rounding."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 256, generator=gen).to(dtype), (torch.randn(64, 256, generator=gen) / 16).to(dtype)
    assert registry.cpu_backend() == "native"
    native = ops.linear(x, w)
    with registry.use_backend("portable"):
        portable = ops.linear(x, w)
    torch.testing.assert_close(native.float(), portable.float(), atol=2e-2 if dtype != torch.float32 else 1e-5,
                               rtol=1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_rounds_to_bf16_in_the_kernel_as_torch_rounds_its_fp32_result(dtype):
    """out_dtype=bf16 gives the bits of the fp32 result's .to(torch.bfloat16), bias included: ties
    (to even), overflow to Inf, subnormals, and NaN (torch writes 0xffff)."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(37, 70, generator=gen), torch.randn(29, 70, generator=gen)
    a[0, :] = 0.0
    a[0, 0], b[:, 0] = 1.0, torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -3.4e38, 1e-40, 2.0**-130, float("inf"),
                                          float("-inf"), float("nan")] + [1 + 2**-9] * 20)
    a[3, 5] = float("nan")
    a, b = a.to(dtype), b.to(dtype)
    bias = torch.randn(29, generator=gen)
    for with_bias in (None, bias):
        want = gemm.gemm_nt(a, b, with_bias).to(torch.bfloat16)
        got = gemm.gemm_nt(a, b, with_bias, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    row0 = gemm.gemm_nt(a[:1].float(), b[:9].float(), out_dtype=torch.bfloat16)
    if dtype == torch.float32:   # the edge values themselves survive only in fp32 operands
        assert row0.view(torch.int16)[0, :8].tolist() == [16256, 16258, 32640, -128, 1, 8, 32640, -128]
        assert row0.view(torch.int16)[0, 8].item() == -1


def test_gemm_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"a, b: expected \[\(B,\) M, K\] and \[\(B,\) N, K\], got \(3, 4\) and \(2, 5\)"):
        gemm.gemm_nt(torch.ones(3, 4), torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"out: expected a torch.float32 tensor of shape \(3, 2\) with unit column "
                                         r"stride, got torch.float64"):
        gemm.gemm_nt(torch.ones(3, 4), torch.ones(2, 4), out=torch.empty(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="out: expected a torch.bfloat16 tensor of shape"):
        gemm.gemm_nt(torch.ones(3, 4), torch.ones(2, 4), out=torch.empty(3, 2), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out_dtype: expected torch.float32 or torch.bfloat16 \(torch.float64 for "
                                         r"float64 operands\), got torch.float16"):
        gemm.gemm_nt(torch.ones(3, 4), torch.ones(2, 4), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out: expected a contiguous torch.float32 tensor of shape"):
        gemm.weight_grad(torch.ones(3, 4), torch.ones(3, 5), out=torch.empty(5, 4))
    with pytest.raises(ValueError, match="out: expected a contiguous torch.float64 tensor of shape"):
        gemm.weight_grad(torch.ones(3, 4, dtype=torch.float64), torch.ones(3, 5), out=torch.empty(4, 5))
    with pytest.raises(ValueError, match="out_dtype, parts: float64 operands give a float64 product in one part, got "
                                         "torch.float32 in 1"):
        gemm.gemm_nt(torch.ones(3, 4, dtype=torch.float64), torch.ones(2, 4))
    with pytest.raises(ValueError, match="got torch.float64 in 2"):
        gemm.gemm_nt(torch.ones(3, 4, dtype=torch.float64), torch.ones(2, 4), out_dtype=torch.float64, parts=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_unit_trees_weight_gradient_in_one_call_is_the_composition_bit_for_bit(unfused, dtype, isa, monkeypatch):
    """fixed_order.weight_grad_node (a piece of units' canonical tree node of per-unit weight
    gradients) in one kernel call against tree_node_into over separate GEMMs and tensor adds, on
    every instruction set and 1 to 3 threads: 2 to 16 units, empty units, units of 4,100 rows (the
    long-K blocks of a separate GEMM; the kernel's limit on a unit's length lifted for them),
    magnitudes six decades apart, NaN and Inf (compared as NaN). Then a linear and the LM head
    inside a unit tree, whose pieces take it: the same trees."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.numerics import grad_tree
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(12)
    long = torch.ones(4101, 1).to(dtype)
    assert gemm.weight_grad_node(long, long, [0, 4100, 4101], torch.empty(1, 1)) is None, "long units decline"
    monkeypatch.setattr(gemm, "_NODE_UNIT_BYTES", 1 << 40)
    cases = (([0, 5, 5, 37, 40], 70, 33), (list(range(0, 1025, 64)), 300, 64),
             ([0, 0, 0, 1, 9, 9, 20, 21, 300], 40, 130), ([0, 4100, 4101], 8, 12))
    for name, threads, (bounds, n, k) in itertools.product(build.supported_isas(), (1, 2, 3), cases):
        isa(name)
        rows = bounds[-1]
        g = (torch.randn(rows, n, generator=gen) * 10.0 ** torch.randint(-3, 3, (rows, 1), generator=gen)).to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        g[rows // 2, 3], x[rows - 1, 2] = float("nan"), float("inf")
        got = []
        for kernels in (KERNELS, unfused):
            with num_threads(threads):
                got.append(fo.weight_grad_node(g, x, bounds, torch.empty(n, k), [], kernels=kernels))
        assert torch.equal(_bits(got[0]), _bits(got[1])), (name, threads, bounds[:4])
    # Inside a unit tree: four units of unequal length in one micro-batch, so each tree gets one
    # piece of four units, its node made in one call on the native set.
    offsets = [0, 3, 10, 10, 17]
    x = torch.randn(17, 24, generator=gen).to(dtype)
    w, head = (torch.randn(40, 24, generator=gen) / 4).to(dtype), (torch.randn(300, 40, generator=gen) / 4).to(dtype)
    targets = torch.randint(0, 300, (17,), generator=gen)
    totals = []
    for kernels in (KERNELS, unfused):
        params = [("head", torch.nn.Parameter(head.clone())), ("w", torch.nn.Parameter(w.clone()))]
        trees = grad_tree.UnitTrees(params)
        with trees.active(), grad_tree.unit_rows(offsets, 0):
            hidden = portable_linear.linear(x, params[1][1], None, kernels=kernels)
            portable_slp.selected_logprobs(hidden, params[0][1], targets, 1.0, kernels=kernels).sum().backward()
        totals.append([trees.trees[key].total() for key in trees.keys()])
    assert len(totals[0]) == 2 and all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*totals))
    with pytest.raises(ValueError, match="out: expected a contiguous torch.float32 tensor of shape"):
        gemm.weight_grad_node(g, x, bounds, torch.empty(k, n))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_split_product_in_one_call_is_the_composition_bit_for_bit(unfused, dtype, isa):
    """A tensor-parallel layer's split reduction (linear's split_k forward, split_n input gradient)
    in one GEMM call against split_sum over separate GEMMs and tensor adds, forward and backward, on
    every instruction set and 1 to 3 threads, with row and column tails, 2 to 16 parts, NaN and Inf
    (NaN compared as NaN). fp16, and slices of 8 KB or more, take the composition."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(9)
    cases = ((1, 100, 3072, 4, 2), (5, 6, 64, 2, 2), (9, 36, 512, 8, 4), (32, 40, 2048, 16, 8), (3, 8, 16384, 4, 2))
    for name in build.supported_isas():
        isa(name)
        for threads, (rows, n, k, split_k, split_n) in itertools.product((1, 2, 3), cases):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            w = (torch.randn(n, k, generator=gen) / 8).to(dtype)
            x[0, 3], w[1, 5] = float("nan"), float("inf")
            dy = torch.randn(rows, n, generator=gen).to(dtype)
            dy[-1, 1] = float("nan")
            results = []
            for kernels in (KERNELS, unfused):
                xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
                # The portable op on a chosen kernel set (the native op passes the native set).
                with num_threads(threads):
                    y = portable_linear.linear(xx, ww, None, split_k, split_n, kernels=kernels)
                    y.backward(dy)
                results.append((y.detach(), xx.grad, ww.grad))
            for fused, composed in zip(*results):
                assert torch.equal(_bits(fused), _bits(composed)), (name, threads, rows, n, k)
            if dtype != torch.float16 and k <= 4096:
                assert gemm.split_parts_supported(x, w.t(), split_k)


def test_a_split_product_names_the_parts_it_cannot_take():
    a, b = torch.ones(2, 12), torch.ones(3, 12)
    for parts in (3, 24):
        with pytest.raises(RuntimeError, match=f"in {parts} parts"):
            gemm.gemm_nt(a, b, parts=parts)
    with pytest.raises(RuntimeError, match="in 2 parts"):
        gemm.gemm_nt(a, b, bias=torch.ones(3), parts=2)
    assert not gemm.split_parts_supported(a.half(), b.half().t(), 2)
    from lockstep.numerics import fixed_order as fo

    with pytest.raises(ValueError, match=r"a, b: expected \[M, K\] and \[K, N\]"):
        fo.split_matmul_rows(torch.ones(2, 3, 8), torch.ones(8, 4), 2)


def test_bf16_gemm_order_is_the_documented_one():
    """The bf16 order (tiles.c) restated in Python (K = 75: two full 32-element chunks and a
    zero-filled one): lane j of chunk c adds the product of element 32 c + 2 j + 1, then of 32 c + 2 j,
    each by one fma, then the 16 lanes fold. And the flush at the smallest normal that the order
    defines (tininess after rounding with an unbounded exponent): a dot that plain rounding leaves at
    2^-126 is 0."""
    from lockstep.tools.backend_bits import BF16_TININESS

    gen = torch.Generator().manual_seed(8)
    k = 75
    a, b = (torch.randn(n, k, generator=gen).bfloat16() for n in (3, 5))
    got = gemm.gemm_nt(a, b)
    af, bf = (torch.nn.functional.pad(t.float(), (0, 96 - k)) for t in (a, b))
    for i in range(3):
        for j in range(5):
            lanes = torch.zeros(16)
            for c in range(0, 96, 32):
                for odd in (1, 0):
                    idx = torch.arange(16) * 2 + c + odd
                    lanes = _fma32(af[i, idx], bf[j, idx], lanes)
            t = lanes[:8] + lanes[8:]
            u = t[:4] + t[4:]
            v = u[:2] + u[2:]
            assert torch.equal(got[i, j], v[0] + v[1]), (i, j)
    x, y = BF16_TININESS
    assert gemm.gemm_nt(x[None], y[None]).item() == 0.0
    assert (x.double() * y.double()).sum().item() > 0.99 * 2.0 ** -126     # the exact dot: just below 2^-126


_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_products_of_one_input_in_one_call_have_the_bits_of_a_call_each(dtype, isa):
    """ls_gemm_nt_group (q, k and v; gate and up) against ls_gemm_nt per product, on every
    instruction set and 1 to 3 threads: tails in rows, columns and K, a long K in blocks, NaN and
    Inf, a bias on some products and not others, products all too small to wake a thread, and one
    large enough to beside one too small."""
    gen = torch.Generator().manual_seed(4)
    for name in build.supported_isas():
        isa(name)
        cases = ((5, 64, (64, 32, 32)), (37, 4133, (301, 7)), (1, 200, (3, 96, 160)), (5, 2048, (2048, 8)))
        for threads, (rows, k, widths) in itertools.product((1, 2, 3), cases):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            x[0, 3] = float("nan")
            ws = [torch.randn(n, k, generator=gen).to(dtype) for n in widths]
            ws[-1][1, 5] = float("inf")
            biases = [torch.randn(n, generator=gen).to(dtype) if j % 2 == 0 else None for j, n in enumerate(widths)]
            torch.set_num_threads(threads)
            grouped = gemm.gemm_nt_group_in_layout(x, ws, biases, dtype)
            for y, w, b in zip(grouped, ws, biases, strict=True):
                single = gemm.gemm_nt_in_layout(x, w, b, dtype)
                assert torch.equal(y.view(_INT[dtype]), single.view(_INT[dtype])), (name, threads, rows, k)

