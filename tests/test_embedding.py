import pytest
import torch

import lockstep
from lockstep import ops
from lockstep.backends.portable.embedding import embedding_weight_grad

from _contract_checks import DTYPES, assert_op_contract


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_contract(dtype):
    assert_op_contract("embedding", dtype)


def test_embedding_weight_grad_adds_occurrences_in_position_order():
    ids = torch.tensor([3, 1, 3, 3, 0, 1])
    grad = torch.tensor([[1e8], [1.0], [1.0], [-1e8], [2.0], [5.0]])
    dw = embedding_weight_grad(ids, grad, 5).dense()
    # In position order: ((1e8 + 1) - 1e8) = 0 in fp32; any other order gives a different value.
    assert dw[3, 0] == (torch.tensor(1e8) + 1.0) - 1e8
    assert dw[1, 0] == 6.0 and dw[0, 0] == 2.0 and dw[2, 0] == 0.0 and dw[4, 0] == 0.0


def test_embedding_weight_grad_unchanged_by_zero_grad_rows_anywhere():
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (100,))
    grad = torch.randn(100, 8)
    base = embedding_weight_grad(ids, grad, 20).dense()
    pad_ids = torch.randint(0, 20, (30,))
    mixed_ids = torch.cat([pad_ids[:10], ids[:50], pad_ids[10:], ids[50:]])
    mixed_grad = torch.cat([torch.zeros(10, 8), grad[:50], torch.zeros(20, 8), grad[50:]])
    assert torch.equal(embedding_weight_grad(mixed_ids, mixed_grad, 20).dense(), base)


def test_embedding_shapes_and_int32_ids():
    w = torch.randn(10, 4)
    ids = torch.tensor([[1, 2, 3], [9, 0, 0]], dtype=torch.int32)
    assert torch.equal(ops.embedding(ids, w), w[ids.long()])


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([0, 10]), r"ids: expected values in \[0, 10\), found 10"),
    (torch.tensor([-1]), r"ids: expected values in \[0, 10\), found -1"),
    (torch.tensor([0.0]), "ids: expected an int64 or int32 tensor"),
])
def test_embedding_bad_ids(ids, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ops.embedding(ids, torch.randn(10, 4))


def test_a_tree_of_row_sparse_partials_has_the_dense_trees_bits():
    """Embedding partials stay sparse in the unit trees; every node must be the dense add's bits,
    signed zeros included (-0.0 + 0.0 is +0.0, -0.0 + -0.0 is -0.0)."""
    from lockstep.numerics.fixed_order import TreeSum
    from lockstep.numerics.grad_tree import RowSparse

    gen = torch.Generator().manual_seed(0)
    sparse, dense = TreeSum(), TreeSum()
    for unit in range(7):
        rows = torch.unique(torch.randint(0, 12, (5,), generator=gen))
        values = torch.randn(rows.numel(), 3, generator=gen)
        values[0, 0] = -0.0                           # a -0.0 in a row that other units may lack
        values[-1] = torch.where(torch.rand(3, generator=gen) < 0.5, -0.0, values[-1])
        leaf = RowSparse(rows, values, 12)
        sparse.add(unit, 1, leaf)
        dense.add(unit, 1, leaf.dense())
    got, want = sparse.total().dense(), dense.total()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    lone = RowSparse(torch.tensor([2]), torch.tensor([[-0.0]]), 4) + RowSparse(torch.tensor([3]), torch.tensor([[1.0]]), 4)
    assert torch.equal(lone.dense().view(torch.int32), (torch.tensor([[0.0], [0.0], [-0.0], [0.0]]) +
                                                       torch.tensor([[0.0], [0.0], [0.0], [1.0]])).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_row_sparse_gradient_densified_in_a_narrow_dtype_is_the_rounded_fp32_table(dtype):
    """The embedding gradient outside a unit tree is written straight into the parameter's dtype:
    the bits of the fp32 table rounded after, -0.0 and NaN included, without the fp32 table."""
    from lockstep.numerics.grad_tree import RowSparse

    values = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)) * 1e3
    values[0, 0], values[1, 1], values[2, 2] = -0.0, float("nan"), 1e6
    leaf = RowSparse(torch.tensor([1, 3, 4, 8]), values, 10)
    assert torch.equal(leaf.dense(dtype).view(torch.int16), leaf.dense().to(dtype).view(torch.int16))
    ids = torch.tensor([3, 1, 3, 0])
    w = torch.randn(5, 6).to(dtype).requires_grad_()
    grad = torch.randn(4, 6).to(dtype)
    with lockstep.use_backend("portable"):
        ops.embedding(ids, w).backward(grad)
    assert w.grad.dtype == dtype
    assert torch.equal(w.grad.view(torch.int16), embedding_weight_grad(ids, grad, 5).dense().to(dtype).view(torch.int16))
