"""lockstep.dist.collectives: sums across ranks in the canonical tree's order, and consistency checks.

No sum across ranks is left to a collective's own order: every rank computes the pieces of the
canonical tree (lockstep.numerics.fixed_order.TreeSum) its share covers, and the ranks complete the same tree.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..numerics.fixed_order import TreeSum
from ..model import params_digest

T = TypeVar("T")


def group_size(group) -> int:
    return dist.get_world_size(group)


def tree_all_reduce(t: Tensor, group=None, parts_per_rank: int = 1) -> Tensor:
    """Sum of `t` over the group's ranks by the canonical tree, the same bits on every rank.

    Each rank's `t` is the node of its `parts_per_rank` consecutive parts (rank r holds parts
    r * parts_per_rank ...), so the result is the tree over all parts."""
    n = group_size(group)
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    tree = TreeSum()
    for r, part in enumerate(parts):
        tree.add(r * parts_per_rank, parts_per_rank, part)
    return tree.total()


def all_equal(t: Tensor, group=None) -> tuple[bool, int]:
    """Whether every rank holds the same bits of t; also how many ranks were compared."""
    n = group_size(group)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:]), n


def check_consistent(module: nn.Module, config: object, group=None) -> None:
    """Refuse to start when ranks hold different configs or different initial parameters.

    Every rank compares every rank's digest, so all of them raise together (no rank is left
    waiting in a collective)."""
    cfg = repr(dataclasses.asdict(config)) if dataclasses.is_dataclass(config) else repr(config)
    cfg_digest = torch.tensor(list(hashlib.sha256(cfg.encode()).digest()), dtype=torch.uint8)
    same_cfg, _ = all_equal(cfg_digest, group)
    same_params, n = all_equal(torch.tensor(list(bytes.fromhex(params_digest(list(module.named_parameters())))),
                                            dtype=torch.uint8), group)
    if not same_cfg:
        raise ValueError(f"ranks started with different configs (compared {n} ranks); every rank must run "
                         "the same model and training settings")
    if not same_params:
        raise ValueError(f"ranks started with different initial parameters (compared {n} ranks); load or "
                         "initialise the model with the same checkpoint or seed on every rank")


class RankZeroFailed(RuntimeError):
    """Raised on every other rank when what rank 0 ran for all of them (`from_rank0`) failed."""


def from_rank0(fn: Callable[[], T], what: str) -> T:
    """fn() run on rank 0 alone (a server call, a folder check), its result on every rank.

    If fn raises on rank 0, the error is broadcast in place of the result: rank 0 raises its own
    error and every other rank raises RankZeroFailed naming `what`, so no rank waits for a result that
    will not come. Without a process group (or with one rank) it is fn(). The result travels through
    pickle (broadcast_object_list)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    payload: list = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            payload = [("ok", fn())]
        except Exception as e:
            error = e
            payload = [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    kind, value = payload[0]
    if kind == "error":
        raise RankZeroFailed(f"{what}: rank 0 failed ({value})")
    return value
