import itertools

import pytest
import torch

import lockstep
from lockstep import ops
from lockstep.backends import reference
from lockstep.numerics.fixed_order import ROW_TILE, TAIL_TILE

from _contract_checks import DTYPES, assert_op_contract


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_contract(dtype):
    assert_op_contract("linear", dtype)


def test_linear_one_row_equals_row_of_many_at_every_tile_boundary():
    torch.manual_seed(0)
    x = torch.randn(2 * ROW_TILE + TAIL_TILE + 3, 96)
    w = torch.randn(64, 96) / 96 ** 0.5
    full = ops.linear(x, w)
    for i in (0, TAIL_TILE - 1, TAIL_TILE, ROW_TILE - 1, ROW_TILE, 2 * ROW_TILE, x.shape[0] - 1):
        assert torch.equal(ops.linear(x[i:i + 1], w)[0], full[i])


def test_eager_linear_is_not_batch_invariant():
    """The check this library exists for: stock PyTorch picks a different kernel for one row."""
    torch.manual_seed(0)
    x = torch.randn(64, 1024)
    w = torch.randn(1024, 1024) / 32
    with lockstep.use_backend("eager"):
        assert not torch.equal(ops.linear(x[:1], w)[0], ops.linear(x, w)[0])


def test_linear_leading_dims_and_float64():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    w = torch.randn(4, 8, dtype=torch.float64)
    b = torch.randn(4, dtype=torch.float64)
    y = ops.linear(x, w, b)
    assert y.shape == (2, 3, 5, 4) and y.dtype == torch.float64
    torch.testing.assert_close(y, reference.linear(x, w, b))


def test_linear_weight_grad_unchanged_by_appended_zero_grad_rows():
    torch.manual_seed(1)
    x = torch.randn(200, 48)
    pad = torch.randn(70, 48)
    w = torch.randn(16, 48, requires_grad=True)
    dy = torch.randn(200, 16)
    ops.linear(x, w).backward(dy)
    g1 = w.grad.clone()
    w.grad = None
    ops.linear(torch.cat([x, pad]), w).backward(torch.cat([dy, torch.zeros(70, 16)]))
    assert torch.equal(w.grad, g1)


@pytest.mark.parametrize("make, message", [
    (lambda: ops.linear(torch.randn(2, 3), torch.randn(4, 5)), "weight: expected shape [N, 3]"),
    (lambda: ops.linear(torch.randn(2, 3), torch.randn(4, 3).double()), "weight: expected dtype torch.float32"),
    (lambda: ops.linear(torch.randn(2, 3), torch.randn(4, 3), torch.randn(5)), "bias: expected shape [4]"),
    (lambda: ops.linear(torch.randn(2, 3).long(), torch.randn(4, 3)), "x: expected dtype float32"),
    (lambda: ops.linear([1.0], torch.randn(4, 3)), "x: expected a torch.Tensor"),
    (lambda: ops.linear(torch.randn(2, 3), torch.randn(3)), "weight: expected a 2-D weight"),
])
def test_linear_bad_input(make, message):
    with pytest.raises((TypeError, ValueError)) as e:
        make()
    assert message in str(e.value)


@pytest.mark.parametrize("backend", ["native", "triton", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linears_give_the_bits_of_a_linear_each(backend, dtype, monkeypatch):
    """The projections of one input (q, k and v) with and without a gradient, [T, K] and [B, T, K]
    inputs, a bias on each, on none and on some: the bits of a linear call each. Without a gradient,
    the native backend makes them in one kernel call, and the Triton backend (its interpreter here)
    in one launch where all or none have a bias, as every model's do."""
    from lockstep.backends.native import gemm
    from lockstep.backends.triton import linear as triton_linear

    calls = []
    grouped, launched = gemm.gemm_nt_group_in_layout, triton_linear.gemm_group
    monkeypatch.setattr(gemm, "gemm_nt_group_in_layout", lambda *a: calls.append(1) or grouped(*a))
    monkeypatch.setattr(triton_linear, "gemm_group", lambda *a: calls.append(1) or launched(*a))
    gen = torch.Generator().manual_seed(3)
    ws = [torch.randn(n, 48, generator=gen).to(dtype) for n in (32, 16, 16)]
    each = [torch.randn(n, generator=gen).to(dtype) for n in (32, 16, 16)]
    with lockstep.use_backend(backend):
        for shape, bs in itertools.product(((7, 48), (2, 5, 48)), (each, [None] * 3, [each[0], None, each[2]])):
            x = torch.randn(shape, generator=gen).to(dtype)
            with torch.no_grad():
                ys = ops.linears(x, ws, bs, split_n=2)
            want = [ops.linear(x, w, b, split_n=2) for w, b in zip(ws, bs)]
            assert [y.shape for y in ys] == [y.shape for y in want]
            assert all(torch.equal(y, z) for y, z in zip(ys, want, strict=True))
            leaves = [w.clone().requires_grad_() for w in ws]
            ys = ops.linears(x, leaves, bs, split_n=2)
            assert all(torch.equal(y.detach(), z) for y, z in zip(ys, want, strict=True))
            sum(y.float().sum() for y in ys).backward()
            assert all(w.grad is not None for w in leaves)
    assert len(calls) == {"native": 6, "triton": 4, "portable": 0}[backend]


def test_linears_names_a_bias_list_of_another_length():
    with pytest.raises(ValueError, match=r"^biases: expected one per weight \(2\), got 1$"):
        ops.linears(torch.randn(2, 3), [torch.randn(4, 3), torch.randn(4, 3)], [None])
    with pytest.raises(ValueError, match=r"^weights\[1\]: expected shape \[N, 3\] to match x's last dimension, "
                                         r"got \(4, 5\)$"):
        ops.linears(torch.randn(2, 3), [torch.randn(4, 3), torch.randn(4, 5)])
    with pytest.raises(ValueError, match=r"^biases\[0\]: expected shape \[4\], got \(3,\)$"), torch.no_grad():
        ops.linears(torch.randn(2, 3), [torch.randn(4, 3)], [torch.randn(3)])
    with torch.autocast("cpu", dtype=torch.bfloat16):       # autocast casts first, as linear does
        ys = ops.linears(torch.randn(2, 3, dtype=torch.bfloat16), [torch.randn(4, 3)])
    assert ys[0].dtype == torch.bfloat16
