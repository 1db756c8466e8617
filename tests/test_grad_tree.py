"""lockstep.numerics.grad_tree on its own (docs/adr/0007): a window's weight gradients are one canonical
tree over its units, whatever the micro-batches or ranks that computed them.

`canonical` is an independent recursive reading of the tree's definition; `check_window` holds the
gradients of a window, run through UnitTrees at a given cut into micro-batches or ranks, to it bit
for bit. The leaves' magnitudes span six decades, so any other order of additions shows."""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lockstep.numerics import grad_tree
from lockstep.numerics.fixed_order import TreeSum, column_sum, weight_grad

K, N = 8, 5
ROWS = [3, 1, 6, 0, 4, 2, 5]                # tokens of units 0..6; unit 3 is empty


def bits(t: Tensor) -> Tensor:
    """A float32 tensor's bit patterns: equal means equal bits, NaN payloads and signed zeros included."""
    assert t.dtype == torch.float32
    return t.contiguous().view(torch.int32)


def assert_same_bits(a: Tensor, b: Tensor, what: str = "") -> None:
    assert a.shape == b.shape and torch.equal(bits(a), bits(b)), f"different bits {what}"


def canonical(leaves: list, pairs: list[tuple] | None = None):
    """The canonical tree by its definition: every aligned power-of-two block is its left half plus
    its right half; the maximal blocks that remain (the binary digits of n) are added left to right.
    `pairs` collects the (left, right) operands of every add, in the order they are made."""
    def add(left, right):
        if pairs is not None:
            pairs.append((left, right))
        return left + right

    def node(lo: int, size: int):
        if size == 1:
            return leaves[lo]
        return add(node(lo, size // 2), node(lo + size // 2, size // 2))

    blocks, lo = [], 0
    for bit in reversed(range(len(leaves).bit_length())):
        if len(leaves) >> bit & 1:
            blocks.append(node(lo, 1 << bit))
            lo += 1 << bit
    total = blocks[0]
    for b in blocks[1:]:
        total = add(total, b)
    return total


def window(seed: int = 0, nan_at: tuple[int, int, int] | None = None, k: int = K,
           n: int = N) -> list[tuple[Tensor, Tensor]]:
    """Each unit's rows of a linear's input x [T, k] and upstream gradient [T, n], at a scale of its
    own between 1e-3 and 1e3; nan_at = (unit, row, column) puts a NaN in one unit's x."""
    gen = torch.Generator().manual_seed(seed)
    units = []
    for t in ROWS:
        scale = 10.0 ** (torch.rand((), generator=gen).item() * 6 - 3)
        units.append((torch.randn(t, k, generator=gen) * scale, torch.randn(t, n, generator=gen)))
    if nan_at is not None:
        u, r, c = nan_at
        units[u][0][r, c] = float("nan")
    return units


def unit_leaves(units: list[tuple[Tensor, Tensor]]) -> dict[str, list[Tensor]]:
    """Each unit's partials, computed alone: dW twice (the linear is used twice), db, and the loss."""
    return {"w": [weight_grad(g, x) for x, g in units], "w2": [weight_grad(2 * g, x) for x, g in units],
            "b": [column_sum(g) for _, g in units], "loss": [x.sum() for x, _ in units]}


def run_window(units: list[tuple[Tensor, Tensor]], cuts: list[int]) -> grad_tree.UnitTrees:
    """Units [cuts[0], cuts[-1]) in micro-batches [cuts[i], cuts[i + 1]), through grad_tree as the
    portable linear's backward does: capture at forward, linear_param_grads at backward. The linear
    runs twice per micro-batch (the second time with twice the gradient), so w has two uses."""
    n, k = units[0][1].shape[1], units[0][0].shape[1]
    w, b = torch.nn.Parameter(torch.zeros(n, k)), torch.nn.Parameter(torch.zeros(n))
    trees = grad_tree.UnitTrees([("b", b), ("w", w)])
    with trees.active():
        for lo, hi in zip(cuts, cuts[1:]):
            trees.next_micro_batch()
            x = torch.cat([units[u][0] for u in range(lo, hi)])
            g = torch.cat([units[u][1] for u in range(lo, hi)])
            offsets = [0]
            for u in range(lo, hi):
                offsets.append(offsets[-1] + ROWS[u])
            with grad_tree.unit_rows(offsets, lo):
                for scale in (1, 2):
                    use_w = grad_tree.capture("linear", w, x.shape[0], True)
                    use_b = grad_tree.capture("linear", b, x.shape[0], scale == 1)
                    dw, db = grad_tree.linear_param_grads(use_w, use_b, scale * g, x, w.dtype, True, scale == 1,
                                                          weight_grad, column_sum)
                    assert dw is None and db is None, "inside a window the partials go to the trees"
            for u in range(lo, hi):
                trees.add_loss(u, units[u][0].sum())
    return trees


def complete(ranks: list[grad_tree.UnitTrees]) -> tuple[dict[str, Tensor], Tensor]:
    """The trees' totals, combined into gradients: one rank's trees total themselves (as
    train.sync.SingleProcessSync does); several ranks' pieces, in unit order, are finished by one
    TreeSum (as the owner of a shard does in lockstep.dist)."""
    keys = ranks[0].keys()
    if len(ranks) == 1:
        return grad_tree.combine({k: ranks[0].trees[k].total() for k in keys}, ranks[0].params), ranks[0].loss.total()
    totals, loss = {}, TreeSum()
    for k in keys:
        tree = TreeSum()
        for r in ranks:
            for start, size, value in r.trees[k].pieces:
                tree.add(start, size, grad_tree.dense(value))
        totals[k] = tree.total()
    for r in ranks:
        for start, size, value in r.loss.pieces:
            loss.add(start, size, value)
    return grad_tree.combine(totals, ranks[0].params), loss.total()


def check_window(units: list[tuple[Tensor, Tensor]], layout: list[list[int]]) -> None:
    """The gradients and loss of the window, run as one rank per list of micro-batch cuts in
    `layout` (ranks computed last to first), are the canonical trees of the units' partials."""
    ranks = [run_window(units, cuts) for cuts in reversed(layout)][::-1]
    grads, loss = complete(ranks)
    leaves = unit_leaves(units)
    assert sorted(grads) == ["b", "w"]
    assert_same_bits(grads["w"], canonical(leaves["w"]) + canonical(leaves["w2"]), "in w")
    assert_same_bits(grads["b"], canonical(leaves["b"]), "in b")
    assert_same_bits(loss, canonical(leaves["loss"]), "in the loss")


U = len(ROWS)
LAYOUTS = {
    "one micro-batch": [[0, U]],
    "one unit each": [list(range(U + 1))],
    "uneven micro-batches": [[0, 3, 4, U]],
    "ragged micro-batches": [[0, 2, 5, 6, U]],
    "2 ranks": [[0, 4], [4, U]],
    "3 ranks, micro-batched": [[0, 1, 3], [3, 5], [5, 6, U]],
    "4 ranks": [[0, 2], [2, 4], [4, 6], [6, U]],
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_windows_gradients_are_the_canonical_tree_in_every_layout(layout: list[list[int]]):
    check_window(window(), layout)


def test_the_layouts_give_one_set_of_bits():
    """The same as the test above, said directly: every layout's bits are the first one's."""
    units = window(seed=3)
    results = [complete([run_window(units, cuts) for cuts in layout]) for layout in LAYOUTS.values()]
    for grads, loss in results[1:]:
        assert_same_bits(grads["w"], results[0][0]["w"])
        assert_same_bits(grads["b"], results[0][0]["b"])
        assert_same_bits(loss, results[0][1])


class LeftToRight(TreeSum):
    """A plausible wrong tree: it keeps the leaves and adds them in index order."""

    def add(self, start: int, size: int, value: Tensor, donated: bool = False) -> None:
        self.pieces.append((start, size, value))

    def total(self) -> Tensor:
        out = self.pieces[0][2]
        for _, _, value in self.pieces[1:]:
            out = out + value
        return out


def test_a_left_to_right_sum_is_caught(monkeypatch: pytest.MonkeyPatch):
    """Planted fault: unit trees that add their units left to right. (With one micro-batch per
    unit a left-to-right sum is itself layout-invariant; only the canonical reference tells.) A
    wider window than the others', since the two orders give most elements the same bits (at K, N
    = 8, 5 only 6 of 45 differ, and which ones follow the GEMM's bits)."""
    monkeypatch.setattr(grad_tree, "TreeSum", LeftToRight)
    with pytest.raises(AssertionError, match="different bits"):
        check_window(window(k=64, n=32), LAYOUTS["one unit each"])


def test_trees_must_be_fed_in_unit_order():
    t = TreeSum()
    t.add(0, 1, torch.ones(2))
    with pytest.raises(ValueError, match="start: expected the next index 1, got 2"):
        t.add(2, 1, torch.ones(2))
    with pytest.raises(ValueError, match=r"size: expected an aligned power-of-two block, got \[1, 4\)"):
        t.add(1, 3, torch.ones(2))


class Operands(TorchFunctionMode):
    """Records the two operands of every add (copies, before an in-place add changes one)."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[Tensor, Tensor]] = []

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("add", "add_", "__add__", "__iadd__"):
            self.pairs.append((args[0].clone(), args[1].clone()))
        return func(*args, **kwargs)


def check_operand_order(leaves: list[Tensor], donated: list[bool], tree: type[TreeSum] = TreeSum) -> None:
    """Every node of a tree fed `leaves` (those marked donated given away) is left + right in that
    operand order, its total has the reference's bits, and the leaves a caller still holds are
    untouched."""
    held = [leaf.clone() for leaf in leaves]
    expected: list[tuple[Tensor, Tensor]] = []
    reference = canonical(held, expected)
    t = tree()
    with Operands() as seen:
        for i, (leaf, give) in enumerate(zip(leaves, donated)):
            t.add(i, 1, leaf, donated=give)
        total = t.total()
    assert len(seen.pairs) == len(expected)
    for (left, right), (want_left, want_right) in zip(seen.pairs, expected):
        assert_same_bits(left, want_left, "in a left operand")
        assert_same_bits(right, want_right, "in a right operand")
    assert_same_bits(total, reference, "in the total")
    for leaf, copy, give in zip(leaves, held, donated):
        if not give:
            assert_same_bits(leaf, copy, "in a leaf the caller still holds")


DONATIONS = {"none": [False] * 7, "all": [True] * 7, "mixed": [False, True, True, False, True, False, True],
             "alternating": [True, False] * 3 + [True]}


@pytest.mark.parametrize("donated", DONATIONS.values(), ids=DONATIONS.keys())
def test_in_place_adds_keep_left_plus_right(donated: list[bool]):
    gen = torch.Generator().manual_seed(1)
    check_operand_order([torch.randn(3, 4, generator=gen) * 10.0 ** e for e in range(-3, 4)], donated)


class SwappedInPlace(TreeSum):
    """A plausible wrong tree: a donated left node is written as right + left (the same value for
    finite numbers, but another operation: with two NaNs, another payload)."""

    def add(self, start: int, size: int, value: Tensor, donated: bool = False) -> None:
        self.pieces.append((start, size, value))
        if donated:
            self._owned.add(id(value))
        while len(self.pieces) >= 2 and self.pieces[-2][1] == self.pieces[-1][1] \
                and self.pieces[-2][0] % (2 * self.pieces[-2][1]) == 0:
            right = self.pieces.pop()[2]
            lo, n, left = self.pieces.pop()
            if id(left) in self._owned:
                node = torch.add(right, left, out=left)           # wrong: right + left
            else:
                node = left + right
                self._owned.add(id(node))
            self.pieces.append((lo, 2 * n, node))


def test_a_swapped_in_place_add_is_caught():
    """Planted fault: the in-place node of a donated left operand computes right + left."""
    gen = torch.Generator().manual_seed(1)
    leaves = [torch.randn(3, 4, generator=gen) for _ in range(7)]
    check_operand_order([leaf.clone() for leaf in leaves], DONATIONS["all"])
    with pytest.raises(AssertionError, match="different bits in a left operand"):
        check_operand_order(leaves, DONATIONS["all"], SwappedInPlace)


def test_a_nan_in_one_unit_stays_in_its_own_elements():
    """docs/contract.md: NaN equals NaN at the same place, and a NaN reaches nothing but the
    elements it is added into. A NaN in one token's input of unit 4 makes column 2 of dW NaN in
    every layout, and leaves every other bit of the window as it was."""
    clean = window(seed=5)
    poisoned = window(seed=5, nan_at=(4, 1, 2))
    for layout in LAYOUTS.values():
        check_window(poisoned, layout)
    grads, loss = complete([run_window(poisoned, cuts) for cuts in LAYOUTS["2 ranks"]])
    base, base_loss = complete([run_window(clean, cuts) for cuts in LAYOUTS["2 ranks"]])
    assert bool(grads["w"][:, 2].isnan().all())
    others = [c for c in range(K) if c != 2]
    assert_same_bits(grads["w"][:, others], base["w"][:, others], "outside the NaN's column")
    assert_same_bits(grads["b"], base["b"], "in b, which the NaN does not reach")
    assert math.isnan(loss.item()) and not math.isnan(base_loss.item())


def test_row_sparse_leaves_give_the_dense_trees_bits():
    """An embedding's unit partials touch a few rows of the table: their tree, NaN and -0.0 included,
    has the bits of the tree of the dense partials."""
    gen = torch.Generator().manual_seed(2)
    size, width = 12, 3
    leaves = []
    for rows in ([1, 4, 7], [4], [0, 11], [2, 4, 5, 7], [], [9]):
        values = torch.randn(len(rows), width, generator=gen) * 10.0 ** torch.randint(-3, 4, (len(rows), 1),
                                                                                    generator=gen)
        leaves.append(grad_tree.RowSparse(torch.tensor(rows, dtype=torch.int64), values, size))
    leaves[3].values[1, 0] = -0.0                    # row 4 of unit 3
    leaves[2].values[0, 0] = -0.0                    # row 0 of unit 2, alone in its row
    leaves[5].values[0, 1] = float("nan")            # row 9 of unit 5
    dense = canonical([leaf.dense() for leaf in leaves])
    sparse = canonical(leaves)
    assert_same_bits(sparse.dense(), dense)
    tree = TreeSum()
    for i, leaf in enumerate(leaves):
        tree.add(i, 1, leaf, donated=True)
    assert_same_bits(grad_tree.dense(tree.total()), dense)
    assert torch.isnan(dense).nonzero().tolist() == [[9, 1]], "the NaN stays in its element"
    assert bits(dense[0, 0]).item() == 0, "-0.0 + 0.0 is +0.0, as the dense add gives"


def test_rows_per_token_are_kept_apart_and_reduced_last():
    """A q/k norm sees heads x tokens rows: a unit's partial keeps the heads apart ([heads, H]), and
    combine adds the heads by the same tree after the units."""
    heads, hidden = 2, 3
    gen = torch.Generator().manual_seed(4)
    tokens = [2, 3, 1]
    gxhat = [torch.randn(t * heads, hidden, generator=gen) * 10.0 ** (2 * u - 2) for u, t in enumerate(tokens)]
    weight = torch.nn.Parameter(torch.ones(hidden))
    trees = grad_tree.UnitTrees([("norm", weight)])
    rows = torch.cat(gxhat)
    with trees.active(), grad_tree.unit_rows([0, 2, 5, 6], 0):
        use = grad_tree.capture("rms_norm", weight, rows.shape[0], True)
        assert use is not None and use.per_token == heads and use.offsets == (0, 4, 10, 12)
        grad_tree.per_unit(use, rows.shape[0],
                           lambda s, e: column_sum(rows[s:e].reshape(-1, heads * hidden)).view(heads, hidden))
    grads = grad_tree.combine({k: trees.trees[k].total() for k in trees.keys()}, {"norm": weight})
    per_unit = [column_sum(g.reshape(-1, heads * hidden)).view(heads, hidden) for g in gxhat]
    by_units = canonical(per_unit)
    assert_same_bits(grads["norm"], canonical([by_units[0], by_units[1]]))


def test_clear_errors():
    weight = torch.nn.Parameter(torch.ones(3))
    trees = grad_tree.UnitTrees([("w", weight)])
    with trees.active():
        with pytest.raises(RuntimeError, match=r"linear: called for w inside a layout-invariant window without unit "
                                               r"rows \(wrap the forward in lockstep.numerics.grad_tree.unit_rows\)"):
            grad_tree.capture("linear", weight, 4, True)
        with grad_tree.unit_rows([0, 2, 5], 0):
            with pytest.raises(ValueError, match="linear: 7 rows for w are not a whole number of rows per token "
                                                 "of the 5 tokens"):
                grad_tree.capture("linear", weight, 7, True)
            with pytest.raises(ValueError, match="linear: its weight is a view or copy of a parameter"):
                grad_tree.capture("linear", weight * 1, 5, True)
            assert grad_tree.capture("linear", weight, 5, False) is None, "a gradient not needed is not captured"
        with pytest.raises(ValueError, match=r"offsets: expected non-decreasing token offsets starting at 0, "
                                             r"got \[0, 3, 2\]"):
            with grad_tree.unit_rows([0, 3, 2], 0):
                pass
    assert grad_tree.capture("linear", weight, 4, True) is None, "outside a window the ops reduce as before"


@pytest.mark.parametrize("first, units", [(0, 8), (3, 8), (0, 5), (5, 1), (6, 7), (0, 1)])
def test_pieces_built_chunk_by_chunk_give_the_unit_trees_bits(first: int, units: int):
    """grad_tree.per_piece with fixed_order.tree_node_into (the LM head's way: each aligned block of a
    call's units as one piece, its node formed chunk by chunk from reused buffers) gives the bits
    of per_unit's leaf-by-leaf tree, and the pieces are the maximal aligned blocks."""
    from lockstep.numerics.fixed_order import tree_node_into

    gen = torch.Generator().manual_seed(first * 31 + units)
    leaves = [torch.randn(10, 3, generator=gen) * 10 ** torch.randint(-3, 4, (10, 3), generator=gen) for _ in range(units)]
    pieces = grad_tree.aligned_pieces(first, units)
    assert sum(size for _, size in pieces) == units and pieces[0][0] == first
    assert all(start % size == 0 and size & (size - 1) == 0 for start, size in pieces)

    def totals(build: Callable) -> Tensor:
        tree = TreeSum()
        for i in range(first):
            tree.add(i, 1, torch.zeros(10, 3))
        use = grad_tree.Use(tree, tuple(range(units + 1)), first, 1)
        assert build(use) is None
        return tree.total()

    want = totals(lambda use: grad_tree.per_unit(use, units, lambda a, b: leaves[a].clone()))
    spare: list[Tensor] = []

    def node(bounds: list[int]) -> Tensor:
        out = torch.empty(10, 3)
        for rows in (slice(0, 6), slice(6, 10)):            # two "vocabulary chunks", the last narrower
            tree_node_into(out[rows], len(bounds) - 1, spare,
                           lambda i, buf: buf.copy_(leaves[bounds[i]][rows]))
        return out

    got = totals(lambda use: grad_tree.per_piece(use, units, node))
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    assert len(spare) <= max(1, units).bit_length() + 1
    with pytest.raises(ValueError, match="leaves: expected a power of two, got 3"):
        tree_node_into(torch.empty(2), 3, [], lambda i, buf: buf.fill_(1.0))


@pytest.mark.parametrize("sparse_first", [True, False])
def test_a_tied_tables_sparse_and_dense_uses_add_with_the_dense_bits(sparse_first: bool):
    """combine adds a tied table's RowSparse embedding total and its dense LM-head total without
    densifying the sparse one, with the bits of dense + dense: -0.0 in the dense total becomes +0.0
    outside the sparse rows, and -0.0 + -0.0 stays -0.0 inside them."""
    d = torch.tensor([[-0.0, 1.0], [2.0, -0.0], [-0.0, -0.0], [3.0, float("nan")]])
    s = grad_tree.RowSparse(torch.tensor([1, 2]), torch.tensor([[-0.0, -0.0], [-0.0, 5.0]]), 4)
    params = {"w": torch.nn.Parameter(torch.zeros(4, 2))}
    keys = [("w", "a", 0), ("w", "b", 0)]
    want = s.dense() + d if sparse_first else d + s.dense()
    totals = dict(zip(keys, (s, d) if sparse_first else (d, s)))
    got = grad_tree.combine(totals, params)["w"]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert got[2, 0].item() == 0.0 and math.copysign(1, got[2, 0].item()) == -1
    assert math.copysign(1, got[0, 0].item()) == 1
