"""Weight gradients that do not depend on how a training window is split (docs/adr/0007).

A window is the ordered list of whole sequences of one optimizer step; its sequences are its
*units*, numbered 0, 1, ... in window order. While a `UnitTrees` is active, every op that reduces a
weight gradient over rows (linear, rms_norm, embedding, selected_logprobs, on the portable and
Triton backends) reduces it unit by unit instead: a unit's partial depends only on that unit's rows,
and it goes into the parameter's `TreeSum` at the unit's index. The trees are the same whatever the
micro-batch size, the number of accumulation steps or the data-parallel rank that computed a unit,
and `combine` turns the completed trees into gradients. Outside a `UnitTrees`, the ops reduce over
all rows of the call as before.

The caller says which rows belong to which unit with `unit_rows(offsets, first)`: token offsets
like cu_seqlens, and the window index of the first unit. An op whose rows are a multiple of the
tokens (q and k norms see heads x tokens rows) keeps the rows of one token together: its partial
keeps that extra dimension, which `combine` reduces last, by the same tree, after a gather across
tensor-parallel ranks where the dimension is sharded.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from .fixed_order import TreeSum, accumulate_dtype, tree_sum

_TREES: contextvars.ContextVar["UnitTrees | None"] = contextvars.ContextVar("lockstep_unit_trees", default=None)
_ROWS: contextvars.ContextVar["UnitRows | None"] = contextvars.ContextVar("lockstep_unit_rows", default=None)


@dataclass(frozen=True)
class UnitRows:
    """Token offsets [units + 1] of the units in the rows of the ops called, and the window index
    of the first of them."""

    offsets: tuple[int, ...]
    first: int

    @property
    def tokens(self) -> int:
        return self.offsets[-1]


@contextlib.contextmanager
def unit_rows(offsets: Tensor | list[int], first: int) -> Iterator[None]:
    """Inside the block, the rows of op calls belong to units first, first + 1, ... by `offsets`
    ([units + 1] token offsets starting at 0, like cu_seqlens). Does nothing when no UnitTrees is
    active, so callers can set it unconditionally."""
    if _TREES.get() is None:
        yield
        return
    offsets = tuple(int(o) for o in (offsets.tolist() if isinstance(offsets, Tensor) else offsets))
    if not offsets or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"offsets: expected non-decreasing token offsets starting at 0, got {list(offsets)[:8]}")
    token = _ROWS.set(UnitRows(offsets, int(first)))
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextlib.contextmanager
def subset_rows(tokens: Tensor) -> Iterator[None]:
    """Inside the block, op calls see only the rows `tokens` (sorted indices into the tokens of the
    enclosing `unit_rows`, as an expert of a mixture sees the tokens routed to it): each unit keeps
    its own tokens among them, possibly none. Does nothing outside a UnitTrees."""
    where = _ROWS.get()
    if _TREES.get() is None or where is None:
        yield
        return
    bounds = torch.tensor(where.offsets, dtype=tokens.dtype, device=tokens.device)
    with unit_rows(torch.searchsorted(tokens, bounds), where.first):
        yield


@dataclass
class Use:
    """One op call's use of one parameter: the tree its unit partials go to, and where each unit's
    rows lie in the call (row offsets; `per_token` rows per token)."""

    tree: TreeSum
    offsets: tuple[int, ...]
    first: int
    per_token: int


def capture(op: str, weight: Tensor | None, rows: int, needed: bool) -> Use | None:
    """Called by an op's forward for each parameter whose gradient it reduces over its `rows` rows.
    Returns None (reduce over the whole call) unless a UnitTrees is active and the gradient is
    `needed`."""
    trees = _TREES.get()
    if trees is None or weight is None or not needed:
        return None
    return trees.use(op, weight, rows)


class RowSparse:
    """A [size, D] partial whose rows outside `rows` are exactly +0.0: an embedding gradient of one
    unit, which touches at most its tokens' rows of a vocabulary-sized table.

    rows: [n] int64, sorted and distinct; values: [n, D]. `a + b` gives the bits of the dense sum
    dense(a) + dense(b), elementwise: a row in both is va + vb, a row in one is v + 0.0 (which turns
    -0.0 into +0.0, as the dense add does). So a tree of RowSparse leaves has the dense tree's bits,
    at the memory of the rows touched."""

    def __init__(self, rows: Tensor, values: Tensor, size: int):
        self.rows, self.values, self.size = rows, values, size

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.size,) + tuple(self.values.shape[1:]))

    def __add__(self, other: "RowSparse") -> "RowSparse":
        if not isinstance(other, RowSparse) or other.shape != self.shape:
            return NotImplemented
        rows, where = torch.unique(torch.cat([self.rows, other.rows]), sorted=True, return_inverse=True)
        left, right = where[:self.rows.numel()], where[self.rows.numel():]
        out = self.values.new_zeros((rows.numel(),) + tuple(self.values.shape[1:]))
        out[left] = self.values
        out[right] = out[right] + other.values            # in both: va + vb; right only: 0.0 + vb
        only_left = torch.zeros(rows.numel(), dtype=torch.bool, device=rows.device)
        only_left[left] = True
        only_left[right] = False
        out[only_left] = out[only_left] + 0.0              # left only: va + 0.0
        return RowSparse(rows, out, self.size)

    def add_dense(self, d: Tensor, self_first: bool) -> Tensor:
        """dense(self) + d (self_first) or d + dense(self), written into d (which the caller gives
        up: a vocabulary-sized table is neither copied nor allocated again), without the zero table:
        a row outside `rows` is d + 0.0, the bits of 0.0 + d (which turns -0.0 into +0.0, as the
        dense add does)."""
        picked = d[self.rows]
        d.add_(0.0)
        d[self.rows] = self.values + picked if self_first else picked + self.values
        return d

    def dense(self, dtype: torch.dtype | None = None) -> Tensor:
        """[size, D] in `dtype` (default: the values' dtype). Written directly in a narrower dtype,
        which gives the bits of densifying first and rounding after, without the wide table."""
        out = self.values.new_zeros(self.shape, dtype=dtype)
        out[self.rows] = self.values.to(out.dtype)
        return out


def dense(t: "Tensor | RowSparse", dtype: torch.dtype | None = None) -> Tensor:
    """A partial as a dense tensor, in `dtype` when given."""
    if isinstance(t, RowSparse):
        return t.dense(dtype)
    return t if dtype is None else t.to(dtype)


def per_unit(use: Use | None, rows: int, partial: Callable[[int, int], "Tensor | RowSparse"],
             dtype: torch.dtype | None = None) -> Tensor | None:
    """The gradient of one op call: partial(0, rows) when `use` is None (dense); otherwise
    partial(start, stop) for each unit's rows, handed to the unit tree, and None (autograd then adds
    nothing). Each partial must be a tensor no one else holds (or a RowSparse): the tree adds into
    it in place and may hand it out again through `empty`. The dense gradient is in `dtype` when
    given."""
    if use is None:
        return dense(partial(0, rows), dtype)
    for i in range(len(use.offsets) - 1):
        use.tree.add(use.first + i, 1, partial(use.offsets[i], use.offsets[i + 1]), donated=True)
    return None


def aligned_pieces(first: int, units: int) -> list[tuple[int, int]]:
    """The units [first, first + units) as maximal aligned power-of-two blocks, in order: (start,
    size) pairs, each a node of the canonical tree (fixed_order.TreeSum) over its units."""
    pieces, start, end = [], first, first + units
    while start < end:
        size = start & -start if start else 1 << (end - 1).bit_length()
        while start + size > end:
            size //= 2
        pieces.append((start, size))
        start += size
    return pieces


def per_piece(use: Use | None, rows: int, node: Callable[[list[int]], Tensor]) -> Tensor | None:
    """`per_unit` for an op that builds tree nodes itself: node(bounds) must return the canonical
    tree's node over the units whose row offsets (in the call) are `bounds` [size + 1], that is, the
    pairwise sum of the units' partials, left + right, as `fixed_order.TreeSum` forms it; each
    aligned block of the call's units goes to the unit tree as one piece. Outside a unit tree it
    returns node([0, rows]), the one partial over all rows. The same bits as `per_unit` with the
    units' partials, with one piece-sized tensor written per piece instead of one per unit."""
    if use is None:
        return node([0, rows])
    for start, size in aligned_pieces(use.first, len(use.offsets) - 1):
        i = start - use.first
        use.tree.add(start, size, node(list(use.offsets[i:i + size + 1])), donated=True)
    return None


def empty(use: Use | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised tensor for a unit's partial: inside a unit tree, the tensor of a partial
    already merged away when one is free (a vocabulary-sized LM-head partial is worth reusing)."""
    if use is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return use.tree.spare(shape, dtype, device)


class UnitTrees:
    """The unit trees of one window: a TreeSum for each (parameter, op, use) and one for the loss.

    `with trees.active():` routes the ops' weight gradients here; call `next_micro_batch()` before
    each micro-batch's forward, so that a parameter used twice by one op (or by two ops, as tied
    embeddings are) keeps one tree per use."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]]):
        self.names = {id(p): n for n, p in named_params}
        self.params = dict(named_params)
        self.trees: dict[tuple[str, str, int], TreeSum] = {}
        self.loss = TreeSum()
        self._uses: dict[tuple[str, str], int] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator["UnitTrees"]:
        token = _TREES.set(self)
        try:
            yield self
        finally:
            _TREES.reset(token)

    def next_micro_batch(self) -> None:
        self._uses = {}

    def use(self, op: str, weight: Tensor, rows: int) -> Use:
        name = self.names.get(id(weight))
        if name is None:
            kind = "a view or copy of a parameter" if not weight.is_leaf else "a tensor the trainer does not train"
            raise ValueError(f"{op}: its weight is {kind}; layout-invariant training needs each trained parameter "
                             "passed to the ops as itself")
        where = _ROWS.get()
        if where is None:
            raise RuntimeError(f"{op}: called for {name} inside a layout-invariant window without unit rows "
                               "(wrap the forward in lockstep.numerics.grad_tree.unit_rows)")
        if rows % max(where.tokens, 1) or (rows == 0) != (where.tokens == 0):
            raise ValueError(f"{op}: {rows} rows for {name} are not a whole number of rows per token of the "
                             f"{where.tokens} tokens in unit_rows")
        per_token = rows // where.tokens if where.tokens else 1
        ordinal = self._uses.get((name, op), 0)
        self._uses[(name, op)] = ordinal + 1
        tree = self.trees.setdefault((name, op, ordinal), TreeSum())
        return Use(tree, tuple(o * per_token for o in where.offsets), where.first, per_token)

    def add_loss(self, unit: int, value: Tensor) -> None:
        self.loss.add(unit, 1, value)

    def keys(self) -> list[tuple[str, str, int]]:
        """The trees in a fixed order: by parameter name, then op, then use."""
        return sorted(self.trees)


def combine(totals: dict[tuple[str, str, int], Tensor], params: dict[str, torch.nn.Parameter],
            gather: Callable[[str, Tensor], Tensor] | None = None) -> dict[str, Tensor]:
    """Gradients {name: tensor in the accumulation dtype} from completed tree totals, which it
    consumes (a dense total may be added into in place).

    A parameter's uses are added in key order. `gather(name, total)` then collects the rows of a
    total whose per-token rows tensor parallelism splits (q and k norms over heads); a total with
    one more dimension than its parameter is reduced over it by the canonical tree."""
    sums: dict[str, Tensor | RowSparse] = {}
    for key in sorted(totals):
        name, total = key[0], totals[key]
        sums[name] = total if name not in sums else _plus(sums[name], total)
    grads: dict[str, Tensor] = {}
    for name, g in sums.items():
        g = dense(g)
        if gather is not None:
            g = gather(name, g)
        if g.dim() == params[name].dim() + 1:
            g = tree_sum(list(g.unbind(0)))
        grads[name] = g
        if grads[name].shape != params[name].shape:
            raise RuntimeError(f"gradient of {name}: shape {tuple(grads[name].shape)}, expected "
                               f"{tuple(params[name].shape)}")
    return grads


def _plus(left: "Tensor | RowSparse", right: "Tensor | RowSparse") -> "Tensor | RowSparse":
    """left + right with the bits of dense(left) + dense(right); a sparse operand is never densified
    (a tied embedding's table is vocabulary-sized)."""
    if isinstance(left, RowSparse) and isinstance(right, RowSparse):
        return left + right
    if isinstance(left, RowSparse):
        return left.add_dense(right, self_first=True)
    if isinstance(right, RowSparse):
        return right.add_dense(left, self_first=False)
    return left + right


def linear_param_grads(use_w: Use | None, use_b: Use | None, grad_y: Tensor, x: Tensor, dtype: torch.dtype,
                       need_w: bool, need_b: bool, weight_grad: Callable[[Tensor, Tensor], Tensor],
                       column_sum: Callable[[Tensor], Tensor],
                       weight_grad_node: Callable[..., Tensor] | None = None) -> tuple[Tensor | None, Tensor | None]:
    """A linear's weight and bias gradients (each None when not needed or sent to a unit tree):
    grad_y [M, N], x [M, K] -> dW [N, K] and db [N] in `dtype`, by the backend's own `weight_grad`
    and `column_sum`, unit by unit inside a window. Every backend's linear shares it. With
    `weight_grad_node` (fixed_order.weight_grad_node's signature), dW goes to the tree a piece of
    units at a time, each piece's node in one call: the same bits."""
    rows = x.shape[0]
    dw = db = None
    if need_w and weight_grad_node is not None:
        def node(bounds: list[int]) -> Tensor:
            first, stop = bounds[0], bounds[-1]
            out = torch.empty((grad_y.shape[-1], x.shape[-1]), dtype=accumulate_dtype(grad_y.dtype),
                              device=grad_y.device)
            return weight_grad_node(grad_y[first:stop], x[first:stop], [b - first for b in bounds], out, [])

        dw = per_piece(use_w, rows, node)
        dw = None if dw is None else dw.to(dtype)
    elif need_w:
        dw = per_unit(use_w, rows, lambda s, e: weight_grad(grad_y[s:e], x[s:e]))
        dw = None if dw is None else dw.to(dtype)
    if need_b:
        db = per_unit(use_b, rows, lambda s, e: column_sum(grad_y[s:e]))
        db = None if db is None else db.to(dtype)
    return dw, db
