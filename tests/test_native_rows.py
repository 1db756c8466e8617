"""The native row passes (rows.c): rms_norm forward and backward, rope, SiLU and silu_mul, row_sum
and log_softmax, each the portable op's or fixed_order's arithmetic bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from lockstep import ops, registry
from lockstep.backends.native import build
from lockstep.harness.check import num_threads

from _native_helpers import DTYPES, _bits
from _native_helpers import isa, unfused  # noqa: F401  (fixtures)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_forward_is_the_portable_arithmetic(dtype, isa):
    """The C forward performs the portable forward's operations in the portable order, so both
    backends give the same bits, forward and backward, on every instruction set, at row lengths
    above, below and between the sum's 512 lanes; with NaN and Inf rows staying in their rows."""
    gen = torch.Generator().manual_seed(5)
    for name, hidden in itertools.product(build.supported_isas(), (1024, 576, 513, 80, 7)):
        isa(name)
        x = (torch.randn(37, hidden, generator=gen) * 3).to(dtype)
        x[3, 1] = float("nan")
        x[5, 0] = float("inf")
        w = torch.randn(hidden, generator=gen).to(dtype)
        grads = {}
        for backend in ("native", "portable"):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            with registry.use_backend(backend):
                y = ops.rms_norm(xx, ww, eps=1e-6, offset=1.0)
            y.backward(torch.ones_like(y))
            grads[backend] = (y.detach(), xx.grad, ww.grad)
        for a, b in zip(grads["native"], grads["portable"]):
            assert torch.equal(_bits(a), _bits(b)), (name, hidden)
        assert torch.isfinite(grads["native"][0][[0, 1, 2, 4] + list(range(6, 37))]).all()


def _rms_norm_unit_partials(backend: str, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor,
                            offsets: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """rms_norm's d x and the weight's unit partials ([heads, H] per unit for heads x tokens rows),
    with the units' token offsets `offsets`, on `backend`."""
    from lockstep.numerics import grad_tree
    from lockstep.numerics.fixed_order import TreeSum

    weight = torch.nn.Parameter(w.clone())
    xx = x.clone().requires_grad_()
    trees = grad_tree.UnitTrees([("norm", weight)])
    leaves = []
    tree_add = TreeSum.add

    def add(tree, start, size, value, donated=False):
        leaves.append(value.clone())   # before the tree adds into it
        tree_add(tree, start, size, value, donated)

    with (trees.active(), grad_tree.unit_rows(offsets, 0), registry.use_backend(backend),
          pytest.MonkeyPatch.context() as patch):
        patch.setattr(TreeSum, "add", add)
        y = ops.rms_norm(xx, weight, eps=1e-6, offset=0.5)
        y.backward(gy)
    assert weight.grad is None, "inside a unit tree the partials go to the tree"
    return xx.grad, leaves


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_backward_in_c_is_the_portable_arithmetic_unit_by_unit(dtype, isa):
    """Inside a unit tree the C backward hands the tree one partial per unit, each with the portable
    column sum's bits: units of 0, 1, 130 and 300 tokens (past the sum's 128-row blocks), one and
    three rows per token (a q/k norm's heads), row lengths 72 and 1024 (strips of 64 columns and a
    partial one), 1 to 3 threads, every instruction set; NaN in one unit stays in that unit's
    partial and its own row of d x."""
    gen = torch.Generator().manual_seed(9)
    offsets = [0, 130, 130, 131, 431]   # unit 1 is empty
    for name, threads, heads, hidden in itertools.product(build.supported_isas(), (1, 2, 3), (1, 3), (72, 1024)):
        if heads == 3 and hidden == 1024 or (name, threads) != ("scalar", 1) and hidden == 72 and heads == 1:
            continue
        isa(name)
        rows = offsets[-1] * heads
        x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
        x[140 * heads, 5] = float("nan")   # token 140: unit 3
        w = torch.randn(hidden, generator=gen).to(dtype)
        gy = torch.randn(rows, hidden, generator=gen).to(dtype)
        with num_threads(threads):
            native = _rms_norm_unit_partials("native", x, w, gy, offsets)
            portable = _rms_norm_unit_partials("portable", x, w, gy, offsets)
        assert torch.equal(_bits(native[0]), _bits(portable[0])), (name, threads, heads, hidden)
        assert len(native[1]) == len(portable[1]) == len(offsets) - 1
        for a, b in zip(native[1], portable[1]):
            assert a.shape == ((heads, hidden) if heads > 1 else (hidden,))
            assert torch.equal(_bits(a), _bits(b)), (name, threads, heads, hidden)
        assert torch.isnan(native[1][3]).any() and not torch.isnan(torch.stack(native[1][:3])).any()
        finite_rows = torch.ones(rows, dtype=torch.bool)
        finite_rows[140 * heads] = False
        assert torch.isfinite(native[0][finite_rows]).all()


def _fused_and_composed(op: str, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor, *args) -> list:
    """op's output and input gradients on the native backend (rope and silu_mul: one C pass each in
    fp32 and bf16) and as the portable composition on the native exp (what the native backend ran
    before them): [(fused, composed), ...]. args: the op's arguments after its tensors, positional
    as the backends take them."""
    import importlib

    from lockstep.backends.native.cpu import KERNELS

    composition = getattr(importlib.import_module(f"lockstep.backends.portable.{op}"), op)
    kernels = {"kernels": KERNELS} if op == "silu_mul" else {}       # rope's portable op has no kernel form
    results = []
    for run in (registry.registered("native")[op], lambda *a: composition(*a, **kernels)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = run(*leaves, *args)
        y.backward(grad)
        results.append([y.detach()] + [t.grad for t in leaves])
    return list(zip(*results))


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
def test_gelu_mul_forward_in_c_is_the_composition_bit_for_bit(dtype, isa):
    """A gelu_mul that records no graph (an engine step) is one C pass (ls_silu mode 4) performing
    the portable composition's operations on the native exp, element for element: the same bits
    on every instruction set and 1 to 3 threads, at sizes around the 512-element blocks, with NaN,
    Inf and -Inf staying in their elements (NaN compared as NaN)."""
    from lockstep.backends.native import silu
    from lockstep.backends.native.cpu import KERNELS
    from lockstep.backends.portable.gelu_mul import gelu_mul as composition

    gen = torch.Generator().manual_seed(9)
    fused = registry.registered("native")["gelu_mul"]
    for name in build.supported_isas():
        isa(name)
        for threads in (1, 2, 3):
            with num_threads(threads):
                for rows, width in ((3, 7), (37, 1000), (1, 513)):
                    gate = (torch.randn(rows, width, generator=gen) * 6).to(dtype)
                    up = torch.randn(rows, width, generator=gen).to(dtype)
                    gate.view(-1)[[5, 1, 2]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
                    with torch.no_grad():
                        got, want = fused(gate, up), composition(gate, up, kernels=KERNELS)
                        assert torch.equal(_bits(got), _bits(want)), (name, threads, rows, width)
                        assert torch.equal(_bits(silu.run("gelu_gated", gate, up)[0]), _bits(want))
                    assert torch.isfinite(got.view(-1)[6:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_and_silu_mul_in_c_are_the_compositions_bit_for_bit(dtype, isa):
    """The fused passes perform the portable operations element for element, forward and backward,
    on every instruction set and 1 to 3 threads: silu_mul at sizes around the 512-element blocks and
    the one-thread cut, rope in both styles at head sizes 2 to 256, with NaN, Inf and -Inf staying
    in their elements. NaN is compared as NaN (`_bits`): the composition's final rounding to bf16
    gives a NaN other bits in torch's vector loop than in its tail. fp16 takes the composition."""
    gen = torch.Generator().manual_seed(8)
    for name in build.supported_isas():
        isa(name)
        for threads in (1, 2, 3):
            with num_threads(threads):
                for rows, width in ((3, 7), (37, 1000), (64, 1024), (1, 513)):
                    gate = (torch.randn(rows, width, generator=gen) * 6).to(dtype)
                    up = torch.randn(rows, width, generator=gen).to(dtype)
                    gate.view(-1)[[5, 1, 2]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
                    up.view(-1)[3] = float("inf")
                    dy = torch.randn(rows, width, generator=gen).to(dtype)
                    for fused, composed in _fused_and_composed("silu_mul", (gate, up), dy):
                        assert torch.equal(_bits(fused), _bits(composed)), (name, threads, rows, width)
                    assert torch.isfinite(ops.silu_mul(gate, up).view(-1)[6:]).all()
                for tokens, heads, head_dim in ((5, 3, 8), (70, 4, 128), (7, 2, 2), (9, 2, 256)):
                    x = (torch.randn(tokens, heads, head_dim, generator=gen) * 3).to(dtype)
                    x[1, 0, 1], x[2, 1, 0] = float("nan"), float("inf")
                    positions = torch.randint(0, 40_000, (tokens,), generator=gen)
                    dy = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
                    for style in ("neox", "gptj"):
                        for fused, composed in _fused_and_composed("rope", (x,), dy, positions, 1e6, style, None):
                            assert torch.equal(_bits(fused), _bits(composed)), (name, threads, head_dim, style)
        if dtype == torch.float16:
            break  # the composition itself, on every instruction set in the digest
    # Empty tensors (whose data pointers may be NULL) pass through, forward and backward.
    gate = torch.empty(0, 8, dtype=dtype, requires_grad=True)
    ops.silu_mul(gate, gate.detach().clone().requires_grad_()).sum().backward()
    x = torch.empty(3, 0, 8, dtype=dtype, requires_grad=True)
    ops.rope(x, torch.arange(3)).sum().backward()
    assert gate.grad.shape == (0, 8) and x.grad.shape == (3, 0, 8)
    assert ops.rope(torch.empty(3, 2, 0, dtype=dtype), torch.arange(3)).shape == (3, 2, 0)
    if dtype == torch.float16:
        return
    # The C pass reads one angle per token: fewer positions than tokens are refused by name.
    with pytest.raises(ValueError, match="positions: expected one per token"):
        registry.resolve("rope", torch.device("cpu"))(torch.ones(4, 2, 8, dtype=dtype), torch.arange(1), 1e4, "neox",
                                                       None)
    # rope's gradient stays differentiable under create_graph, with the portable op's bits.
    x0 = torch.randn(3, 2, 8, generator=gen).to(dtype)
    second = []
    for backend in ("native", "portable"):
        x = x0.clone().requires_grad_()
        with registry.use_backend(backend):
            y = ops.rope(x, torch.arange(3), 1e4, "neox")
            (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
            (gg,) = torch.autograd.grad((g * g).sum(), x)
        second.append((g.detach(), gg))
    assert all(torch.equal(a, b) for a, b in zip(*second))


def test_row_sum_and_log_softmax_in_c_are_the_compositions_bit_for_bit(unfused):
    """row_sum, log_softmax and its backward in C against fixed_order's compositions, at lengths
    below, at and past the sum's 512 lanes and a 152k vocabulary, with NaN, Inf, -inf rows and -0.0
    (whose padded sum is +0), rows whose largest value is -0.0 or +0.0 first, on 1 and 2 threads."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(6)
    for length in (1, 2, 3, 63, 64, 100, 511, 512, 513, 1025, 4097, 151936):
        x = torch.randn(9, length, generator=gen) * 4
        g = torch.randn(9, length, generator=gen)
        if length > 3:
            x[1, 2] = float("nan")
            x[2, 1] = float("inf")
            x[3] = float("-inf")
            x[4] = -0.0
            x[5, ::2] = -0.0
            g[6, 3] = float("nan")
            x[7], x[8] = -x[7].abs(), -x[8].abs()          # largest value zero: the first zero's sign counts
            x[7, 2], x[7, 3], x[8, 2], x[8, 3] = -0.0, 0.0, 0.0, -0.0
        for threads in (1, 2):
            with num_threads(threads):
                want, got = ((fo.row_sum(x, kernels=k), fo.log_softmax_rows(x, kernels=k),
                              fo.log_softmax_rows_backward(g, x.clamp_max(0), kernels=k)) for k in (unfused, KERNELS))
            for name, w, o in zip(("row_sum", "log_softmax", "backward"), want, got):
                assert torch.equal(w.view(torch.int32), o.view(torch.int32)), (name, length, threads)
    assert fo.row_sum(torch.ones(4, 0), kernels=KERNELS).tolist() == [0.0] * 4
    assert torch.equal(fo.row_sum(torch.ones(2, 3, 700), kernels=KERNELS), torch.full((2, 3), 700.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_alone_in_c_is_the_composition_bit_for_bit(unfused, dtype, isa):
    """fixed_order.silu and silu_backward (the batch-invariant mode's aten::silu) in one C pass
    against their PyTorch compositions, on every instruction set and 1 to 3 threads, at sizes around
    the 512-element blocks, with Inf, -Inf and NaN (compared as NaN); fp16 takes the composition."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(10)
    for name in build.supported_isas():
        isa(name)
        for threads, shape in itertools.product((1, 2, 3), ((3, 7), (2, 37, 1000), (1, 513))):
            x = (torch.randn(*shape, generator=gen) * 6).to(dtype)
            x.view(-1)[[1, 2, 5]] = torch.tensor([float("inf"), float("-inf"), float("nan")]).to(dtype)
            dy = torch.randn(*shape, generator=gen).to(dtype)
            results = []
            for kernels in (KERNELS, unfused):
                with num_threads(threads):
                    results.append((fo.silu(x, kernels=kernels), fo.silu_backward(dy, x, kernels=kernels)))
            for fused, composed in zip(*results):
                assert fused.shape == composed.shape and torch.equal(_bits(fused), _bits(composed)), (name, shape)
