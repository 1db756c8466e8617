"""lockstep.train.sync: how a training window is spread over processes, as the Trainer sees it.

`GradientSync` is the whole interface between the Trainer and parallelism. `SingleProcessSync` is its
one-process form; lockstep.dist.data_parallel.ParallelSync is its data- and tensor-parallel form.
The Trainer never calls torch.distributed itself."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from ..numerics import grad_tree


@runtime_checkable
class GradientSync(Protocol):
    """The gradient exchange of one training process: which units of a window it runs, how the unit
    trees are completed across ranks, and the gathers tensor parallelism needs."""

    rank: int
    world: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int

    def share(self, units: int) -> tuple[int, int]:
        """This rank's contiguous run [start, stop) of a window's `units` sequences."""

    def complete(self, trees: grad_tree.UnitTrees, units: int) -> tuple[dict, Tensor]:
        """Every rank's unit trees completed: ({tree key: total}, the loss tree's total)."""

    def gather_rows(self, name: str, g: Tensor) -> Tensor:
        """A partial whose extra dimension tensor parallelism shards, gathered whole."""

    def gather_parts(self, t: Tensor) -> Tensor:
        """This rank's [n] gradient-norm slice sums as every tensor-parallel rank's [tp, n]."""

    def full_tensor(self, name: str, t: Tensor) -> Tensor:
        """Parameter (or optimizer state) `name` whole, from this rank's shard."""

    def shard_tensor(self, name: str, full: Tensor) -> Tensor:
        """This rank's shard of a whole parameter (or optimizer state) `name`."""

    def barrier(self) -> None:
        """Wait for every rank."""


class SingleProcessSync:
    """GradientSync for a trainer that runs alone: every unit is local and the trees complete here."""

    rank, world, dp_rank, dp_size, tp_rank, tp_size = 0, 1, 0, 1, 0, 1

    def share(self, units: int) -> tuple[int, int]:
        return 0, units

    def complete(self, trees: grad_tree.UnitTrees, units: int) -> tuple[dict, Tensor]:
        return {k: trees.trees[k].total() for k in trees.keys()}, trees.loss.total()

    def gather_rows(self, name: str, g: Tensor) -> Tensor:
        return g

    def gather_parts(self, t: Tensor) -> Tensor:
        return t[None]

    def full_tensor(self, name: str, t: Tensor) -> Tensor:
        return t

    def shard_tensor(self, name: str, full: Tensor) -> Tensor:
        return full

    def barrier(self) -> None:
        pass
