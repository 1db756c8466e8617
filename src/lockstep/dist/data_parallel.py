"""lockstep.dist.data_parallel: the Trainer's GradientSync over data- and tensor-parallel ranks.

Each data-parallel rank holds a contiguous run of the window's units and its unit trees hold that
run's pieces. When the pieces are one level of the tree, two-rank all_reduces complete it level by
level; otherwise the pieces are cut into one shard per rank, the owner of a shard receives every
rank's pieces of it (all_to_all), completes the tree and the completed shards are all-gathered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..numerics.fixed_order import TreeSum, ceil_div, pieces_of
from ..numerics.grad_tree import UnitTrees, dense
from .tensor_parallel import head_norms, model_parallel_groups, reduction_parts, tensor_parallel_size


# torch 2.11 and older lack all_gather_single; 2.13 deprecates all_gather_into_tensor in its favour.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def share_of(units: int, rank: int, ranks: int) -> tuple[int, int]:
    """The contiguous run [start, stop) of `units` that data-parallel rank `rank` of `ranks` holds:
    the first units % ranks ranks hold one more."""
    base, extra = divmod(units, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ParallelSync:
    """The GradientSync (lockstep.train.sync) of data- and tensor-parallel ranks: which units this rank
    runs, how the data-parallel ranks complete the unit trees, and the gathers that tensor
    parallelism needs. Call after `initialize_model_parallel` (or without it: pure data parallel)
    and `tensor_parallel`."""

    def __init__(self, model: nn.Module):
        tp_group, self.dp_group = model_parallel_groups()
        self.tp_group = tp_group if tensor_parallel_size() > 1 else None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        self.tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        self.tp_size = tensor_parallel_size()
        self.sharded = {n: dim for n, (dim, _) in reduction_parts(model).items()} if self.tp_size > 1 else {}
        self.head_rows = head_norms(model) if self.tp_size > 1 else set()
        self.pair_groups = self._pair_groups()

    def _pair_groups(self) -> list:
        """For a power-of-two data-parallel size: this rank's two-rank group at each level of the
        butterfly (partner = data-parallel rank xor 2^level). Every rank creates every group, in
        one order, as torch.distributed requires."""
        dp = self.dp_size
        if dp == 1 or dp & (dp - 1):
            return []
        world, tp = self.world, self.tp_size
        dp_groups = [list(range(offset, world, tp)) for offset in range(tp)] if self.dp_group is not None \
            else [list(range(world))]
        mine, level = [], 1
        while level < dp:
            for ranks in dp_groups:
                for a in range(dp):
                    if a < a ^ level:
                        group = dist.new_group([ranks[a], ranks[a ^ level]])
                        if self.rank in (ranks[a], ranks[a ^ level]):
                            mine.append(group)
            level *= 2
        return mine

    def share(self, units: int) -> tuple[int, int]:
        if units < self.dp_size:
            raise ValueError(f"the window holds {units} sequences, fewer than the {self.dp_size} data-parallel ranks; "
                             "raise the global batch")
        return share_of(units, self.dp_rank, self.dp_size)

    def completes_by_pairs(self, units: int) -> bool:
        """Whether `complete` takes the two-rank all_reduce path for a window of `units` units:
        a power-of-two number of ranks each holding the same power-of-two number of units."""
        share = units // self.dp_size
        return bool(self.pair_groups) and units % self.dp_size == 0 and share > 0 and not share & (share - 1)

    def complete(self, trees: UnitTrees, units: int) -> tuple[dict, Tensor]:
        """The totals of every unit tree and of the loss, completed across the data-parallel ranks;
        the same bits on every rank, and those of one process.

        When every rank holds one aligned block of the tree (a power-of-two number of ranks, each
        with the same power-of-two number of units), the blocks are the tree's nodes at one level,
        and the levels above are pairs: log2(ranks) rounds of a two-rank all_reduce, whose one add
        per element (a + b = b + a) is the tree's node. Otherwise each rank's pieces are cut into
        one shard per rank, the owner of a shard completes the tree over everyone's pieces of it
        (all_to_all), and the shards are all-gathered."""
        keys = trees.keys()
        if self.dp_size == 1:
            return {k: trees.trees[k].total() for k in keys}, trees.loss.total()
        shares = [share_of(units, r, self.dp_size) for r in range(self.dp_size)]
        layouts = [pieces_of(a, b) for a, b in shares]
        mine = layouts[self.dp_rank]
        for k in keys:
            if [(s, n) for s, n, _ in trees.trees[k].pieces] != mine:
                raise RuntimeError(f"unit tree {k} on data-parallel rank {self.dp_rank} does not hold every unit "
                                   f"of its share {shares[self.dp_rank]}")
        pieces = [[dense(trees.trees[k].pieces[i][2]) for k in keys] + [trees.loss.pieces[i][2]]
                  for i in range(len(mine))]
        if self.completes_by_pairs(units):
            return self._complete_by_pairs(keys, pieces[0])
        shapes = [v.shape for v in pieces[0]]
        sizes = [v.numel() for v in pieces[0]]
        dtype, total = pieces[0][0].dtype, sum(sizes)
        shard = ceil_div(total, self.dp_size)
        flat = torch.empty((len(mine), self.dp_size * shard), dtype=dtype)
        for i, values in enumerate(pieces):
            torch.cat([v.reshape(-1).to(dtype) for v in values], out=flat[i, :total])
            flat[i, total:].zero_()
        send = flat.view(len(mine), self.dp_size, shard).transpose(0, 1).contiguous() if len(mine) > 1 else flat
        counts = [len(layout) * shard for layout in layouts]
        recv = torch.empty(sum(counts), dtype=dtype)
        dist.all_to_all_single(recv, send.reshape(-1), output_split_sizes=counts,
                               input_split_sizes=[len(mine) * shard] * self.dp_size, group=self.dp_group)
        tree, offset = TreeSum(), 0
        for layout in layouts:
            for start, size in layout:
                tree.add(start, size, recv[offset:offset + shard])
                offset += shard
        done = torch.empty(self.dp_size * shard, dtype=dtype)
        _all_gather_single(done, tree.total().contiguous(), group=self.dp_group)
        parts = done[:total].split(sizes)
        totals = {k: parts[i].view(shapes[i]) for i, k in enumerate(keys)}
        return totals, parts[-1].view(shapes[-1])

    # Tensors at least this large go to the pair rounds in place; smaller ones share one buffer.
    PAIR_BUCKET_NUMEL = 1 << 20

    def _complete_by_pairs(self, keys: list, values: list[Tensor]) -> tuple[dict, Tensor]:
        """Each rank's `values` (one per key, then the loss) are one node of the tree at one level;
        log2(ranks) rounds of two-rank all_reduce add the levels above. Large tensors are reduced in
        place (the trees' pieces are consumed), small ones in one concatenated buffer."""
        out = [v.contiguous() for v in values]
        small = [i for i, v in enumerate(out) if v.numel() < self.PAIR_BUCKET_NUMEL]
        buffers = [v for i, v in enumerate(out) if i not in set(small)]
        if small:
            buffers.append(torch.cat([out[i].reshape(-1) for i in small]))
        for group in self.pair_groups:
            for b in buffers:
                dist.all_reduce(b, group=group)
        if small:
            for i, part in zip(small, buffers[-1].split([values[i].numel() for i in small])):
                out[i] = part.view(values[i].shape)
        return dict(zip(keys, out[:-1])), out[-1]

    def gather_rows(self, name: str, g: Tensor) -> Tensor:
        """The per-head partials [local heads, D] of a replicated weight applied to this rank's heads
        (q and k norms; [D] for one head), gathered over the tensor-parallel ranks in head order;
        other gradients as they are."""
        if name not in self.head_rows:
            return g
        g = g if g.dim() == 2 else g[None]
        parts = [torch.empty_like(g) for _ in range(self.tp_size)]
        dist.all_gather(parts, g.contiguous(), group=self.tp_group)
        return torch.cat(parts)

    def gather_parts(self, t: Tensor) -> Tensor:
        """[tp, n]: every tensor-parallel rank's 1-D `t`, in rank order."""
        if self.tp_group is None:
            return t[None]
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.stack(parts)

    def full_tensor(self, name: str, t: Tensor) -> Tensor:
        """The whole of a parameter-shaped tensor (a parameter or its optimizer state) whose shard
        this rank holds; replicated ones as they are."""
        dim = self.sharded.get(name)
        if dim is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def shard_tensor(self, name: str, full: Tensor) -> Tensor:
        """This rank's shard of a whole parameter-shaped tensor (inverse of full_tensor)."""
        dim = self.sharded.get(name)
        if dim is None:
            return full
        size = full.shape[dim] // self.tp_size
        return full.narrow(dim, self.tp_rank * size, size)

    def all_gather_shards(self, mine: Tensor) -> Tensor:
        """[dp * n]: every data-parallel rank's 1-D `mine` ([n], every rank the same n and dtype),
        in rank order, on every rank: a copy of the bits (the sharded optimizer's parameters)."""
        if self.dp_size == 1:
            return mine
        out = torch.empty(self.dp_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        _all_gather_single(out, mine.contiguous(), group=self.dp_group)
        return out

    def gather_shards(self, mine: Tensor) -> Tensor | None:
        """[dp * n] as all_gather_shards, on data-parallel rank 0 alone (None on the others): the
        sharded optimizer's state, to the checkpoint's writer."""
        if self.dp_size == 1:
            return mine
        root = dist.get_global_rank(self.dp_group, 0) if self.dp_group is not None else 0
        parts = [torch.empty_like(mine) for _ in range(self.dp_size)] if self.dp_rank == 0 else None
        dist.gather(mine.contiguous(), parts, dst=root, group=self.dp_group)
        return torch.cat(parts) if parts is not None else None

    def barrier(self) -> None:
        dist.barrier()
