"""The one tree by which partial sums over an index combine, wherever the parts were computed: the
units of a training window (lockstep.numerics.grad_tree, docs/adr/0007) and the `TP_SPLIT` parts
of a reduction that tensor parallelism may shard (`split_sum`)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

def _siblings(left: tuple[int, int, Tensor], right: tuple[int, int, Tensor]) -> bool:
    """Whether two adjacent pieces are the two halves of one node of the canonical tree."""
    return left[1] == right[1] and left[0] % (2 * left[1]) == 0 and right[0] == left[0] + left[1]


class TreeSum:
    """A sum over the indices 0, 1, ..., n-1 in one canonical tree, fed in index order.

    The tree: node [k 2^j, (k+1) 2^j) = node of its left half + node of its right half, for every
    aligned power-of-two block that fits in [0, n); the maximal blocks that remain (the binary digits
    of n, largest first) are then added left to right. `add(start, size, value)` takes a leaf
    (size 1) or an aligned block that was summed elsewhere by the same tree (a piece); pieces are
    merged as soon as their sibling arrives, so at most about 2 log2(n) are held. Every node is one
    elementwise add of its two halves, so the result does not depend on which process or call
    computed which piece: only on the values of the leaves.
    """

    def __init__(self) -> None:
        self.pieces: list[tuple[int, int, Tensor]] = []
        self._owned: set[int] = set()      # ids of the node tensors no caller holds (added into in place)
        self._spare: Tensor | None = None  # a freed node tensor, for `spare` to hand out

    @property
    def stop(self) -> int | None:
        """The index after the last one added (None when empty)."""
        return self.pieces[-1][0] + self.pieces[-1][1] if self.pieces else None

    def add(self, start: int, size: int, value: Tensor, donated: bool = False) -> None:
        """Add a leaf or piece. `donated`: no caller holds `value`, so the tree may add into it in
        place and hand it out again from `spare` once it is merged away (a vocabulary-sized partial
        then costs no fresh allocation, whose page faults cost more than the add)."""
        if self.pieces and start != self.stop:
            raise ValueError(f"start: expected the next index {self.stop}, got {start} (indices must come in order)")
        if size < 1 or size & (size - 1) or start % size:
            raise ValueError(f"size: expected an aligned power-of-two block, got [{start}, {start + size})")
        self.pieces.append((start, size, value))
        if donated and isinstance(value, Tensor):
            self._owned.add(id(value))
        while len(self.pieces) >= 2 and _siblings(self.pieces[-2], self.pieces[-1]):
            right = self.pieces.pop()[2]
            start_left, size_left, left = self.pieces.pop()
            # Every node is left + right, in that operand order, wherever it is written.
            if id(left) in self._owned:
                node = left.add_(right)
                if id(right) in self._owned:
                    self._owned.discard(id(right))
                    self._spare = right
            elif id(right) in self._owned:
                node = torch.add(left, right, out=right)
            else:
                node = left + right
                if isinstance(node, Tensor):
                    self._owned.add(id(node))
            self.pieces.append((start_left, 2 * size_left, node))

    def spare(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised tensor for the next leaf: the last node tensor merged away when it fits,
        else a new one. Donate it back with `add(..., donated=True)`."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.shape == tuple(shape) and spare.dtype == dtype and spare.device == device:
            return spare
        return torch.empty(shape, dtype=dtype, device=device)

    def total(self) -> Tensor:
        """The sum; the pieces must cover [0, n) (n = `stop`)."""
        if not self.pieces or self.pieces[0][0] != 0:
            raise ValueError("TreeSum: the pieces do not start at index 0")
        self._spare = None
        out = self.pieces[0][2]
        for _, _, value in self.pieces[1:]:
            out = out + value
        return out


def pieces_of(start: int, stop: int) -> list[tuple[int, int]]:
    """The (start, size) pieces a TreeSum fed the leaves start..stop-1 holds at the end."""
    t = TreeSum()
    for i in range(start, stop):
        t.add(i, 1, 0)  # type: ignore[arg-type]  # only the shape of the tree matters here
    return [(s, n) for s, n, _ in t.pieces]


def tree_sum(parts: list[Tensor]) -> Tensor:
    """Sum of parts[0], parts[1], ... by the canonical tree over their index (TreeSum)."""
    t = TreeSum()
    for i, p in enumerate(parts):
        t.add(i, 1, p)
    return t.total()


def split_sum(part: Callable[[int, int], Tensor], length: int, parts: int) -> Tensor:
    """A reduction over a dimension of `length`, cut into `parts` equal slices: part(start, stop)
    reduces one slice; the slices combine by the canonical tree. parts == 1 calls part(0, length)."""
    if length % parts:
        raise ValueError(f"parts: {parts} does not divide the reduced length {length}")
    size = length // parts
    return tree_sum([part(i * size, (i + 1) * size) for i in range(parts)])


def tree_node_into(out: Tensor, leaves: int, spare: list[Tensor], leaf: Callable[[int, Tensor], Tensor]) -> Tensor:
    """`out` = the canonical tree's node over `leaves` leaves (a power of two): each node is left +
    right, as TreeSum forms it. leaf(i, buffer) writes leaf i into `buffer` (a contiguous tensor of
    out's shape) and returns it. Leaves are made in order and merged as their siblings arrive, so at
    most log2(leaves) + 1 buffers are live; they come from `spare` when they fit (out's shape or
    larger in the first dimension) and go back to it for the next call."""
    if leaves == 1:
        return leaf(0, out)
    stack: list[tuple[int, Tensor]] = []          # (size, buffer) of the nodes not yet merged
    for i in range(leaves):
        fits = spare and spare[-1].shape[0] >= out.shape[0] and spare[-1].shape[1:] == out.shape[1:]
        base = spare.pop() if fits else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        node, size = leaf(i, base[:out.shape[0]]), 1
        while stack and stack[-1][0] == size:
            left_base = stack.pop()[1]
            left = left_base[:out.shape[0]]
            if i == leaves - 1 and not stack:
                node = torch.add(left, node, out=out)
                spare.extend([left_base, base])
                return out
            node = left.add_(node)
            spare.append(base)
            base, size = left_base, 2 * size
        stack.append((size, base))
    raise ValueError(f"leaves: expected a power of two, got {leaves}")
