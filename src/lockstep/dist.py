"""lockstep.dist: data and tensor parallelism on torch.distributed, with the bits of one process.

No sum across ranks is left to a collective's own order. Every rank computes the pieces of the
canonical tree (lockstep.fixed_order.TreeSum) that its share covers, and the ranks complete the
same tree, so the result is bitwise what one process computes, at every data- and tensor-parallel
size (docs/contract.md, section 5; docs/adr/0007).

- Data parallel (`Parallel.complete`): each rank holds a contiguous run of the window's units and
  its unit trees hold that run's pieces. When the pieces are one level of the tree, two-rank
  all_reduces complete it level by level; otherwise the pieces are cut into one shard per rank, the
  owner of a shard receives every rank's pieces of it (all_to_all), completes the tree and the
  completed shards are all-gathered.
- Tensor parallel: Megatron-style column- and row-parallel linears. Attention heads and the MLP are
  split across ranks. Every reduction the split shards runs in `TP_SPLIT` parts at every size
  (the model's split_k and split_n); a rank computes its run of parts and `tree_all_reduce`
  completes the tree across the ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import socket
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from . import ops
from .fixed_order import TreeSum, ceil_div, pieces_of
from .grad_tree import UnitTrees, dense
from .model.transformer import Linear, tp_split

DEFAULT_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A rank of a `spawn`ed job raised; the message holds that rank's traceback."""


def _worker(rank: int, fn: Callable, world: int, port: int, backend: str, timeout_s: float, args: tuple,
            errors: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    except BaseException:
        # Recorded before the process group goes down: the other ranks' errors that follow
        # (connection reset, timeout) are consequences, and spawn reports the first one.
        with open(os.path.join(errors, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "time": time.time(), "traceback": traceback.format_exc()}, f)
        raise
    finally:
        if dist.is_initialized():          # fn may end the group itself (lockstep.train.run does)
            dist.destroy_process_group()


def spawn(fn: Callable, nprocs: int, *args, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run fn(rank, world_size, *args) on `nprocs` local processes with a process group.

    If a rank raises, the others are terminated and RankFailed is raised here with the traceback of
    the rank that failed first. Collectives time out after `timeout_s`, so no rank waits forever."""
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs: expected a positive int, got {nprocs!r}")
    with tempfile.TemporaryDirectory(prefix="lockstep-spawn-") as errors:
        try:
            mp.start_processes(_worker, args=(fn, nprocs, free_port(), backend, timeout_s, args, errors),
                               nprocs=nprocs, join=True, start_method="spawn")
        except Exception as e:
            reports = []
            for name in os.listdir(errors):
                with open(os.path.join(errors, name)) as f:
                    reports.append(json.load(f))
            if not reports:
                raise
            first = min(reports, key=lambda r: r["time"])
            raise RankFailed(f"rank {first['rank']} of {nprocs} failed; the job was stopped on every rank.\n"
                             f"{first['traceback']}") from e


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Initialise the process group from torchrun's environment; False when not distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


# --------------------------------------------------------------------------------------------
# Collectives in the canonical order
# --------------------------------------------------------------------------------------------
def _ranks(group) -> int:
    return dist.get_world_size(group)


def tree_all_reduce(t: Tensor, group=None, parts_per_rank: int = 1) -> Tensor:
    """Sum of `t` over the group's ranks by the canonical tree, the same bits on every rank.

    Each rank's `t` is the node of its `parts_per_rank` consecutive parts (rank r holds parts
    r * parts_per_rank ...), so the result is the tree over all parts."""
    n = _ranks(group)
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
    n = _ranks(group)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:]), n


def params_digest(module: nn.Module, extra: str = "") -> Tensor:
    """sha256 of every parameter's bits (by name) and `extra`, as a uint8 tensor [32]."""
    h = hashlib.sha256(extra.encode())
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return torch.tensor(list(h.digest()), dtype=torch.uint8)


def check_consistent(module: nn.Module, config: object, group=None) -> None:
    """Refuse to start when ranks hold different configs or different initial parameters.

    Every rank compares every rank's digest, so all of them raise together (no rank is left
    waiting in a collective)."""
    cfg = repr(dataclasses.asdict(config)) if dataclasses.is_dataclass(config) else repr(config)
    cfg_digest = torch.tensor(list(hashlib.sha256(cfg.encode()).digest()), dtype=torch.uint8)
    same_cfg, _ = all_equal(cfg_digest, group)
    same_params, n = all_equal(params_digest(module), group)
    if not same_cfg:
        raise ValueError(f"ranks started with different configs (compared {n} ranks); every rank must run "
                         "the same model and training settings")
    if not same_params:
        raise ValueError(f"ranks started with different initial parameters (compared {n} ranks); load or "
                         "initialise the model with the same checkpoint or seed on every rank")


# --------------------------------------------------------------------------------------------
# Tensor parallelism (Megatron-style API)
# --------------------------------------------------------------------------------------------
_TP_GROUP = None
_DP_GROUP = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1) -> None:
    """Split the world into tensor-parallel groups of consecutive ranks and data-parallel groups."""
    global _TP_GROUP, _DP_GROUP
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = tensor_model_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or world % tp:
        raise ValueError(f"tensor_model_parallel_size: expected a divisor of the world size {world}, got {tp!r}")
    for start in range(0, world, tp):
        g = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            _TP_GROUP = g
    for offset in range(tp):
        g = dist.new_group(list(range(offset, world, tp)))
        if rank % tp == offset:
            _DP_GROUP = g


def get_tensor_model_parallel_group():
    if _TP_GROUP is None:
        raise RuntimeError("initialize_model_parallel() has not been called")
    return _TP_GROUP


def get_data_parallel_group():
    if _DP_GROUP is None:
        raise RuntimeError("initialize_model_parallel() has not been called")
    return _DP_GROUP


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(get_tensor_model_parallel_group())


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(get_tensor_model_parallel_group())


def _tp_size() -> int:
    return dist.get_world_size(_TP_GROUP) if _TP_GROUP is not None else 1


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward completes the input gradient's tree over the ranks."""

    @staticmethod
    def forward(ctx, x, parts_per_rank):
        ctx.parts_per_rank = parts_per_rank
        return x

    @staticmethod
    def backward(ctx, g):
        return tree_all_reduce(g.contiguous(), get_tensor_model_parallel_group(), ctx.parts_per_rank), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward completes the output's tree over the ranks; backward is the identity."""

    @staticmethod
    def forward(ctx, x, parts_per_rank):
        return tree_all_reduce(x, get_tensor_model_parallel_group(), parts_per_rank)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate the ranks' slices of the last dimension; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x):
        group = get_tensor_model_parallel_group()
        parts = [torch.empty_like(x) for _ in range(_ranks(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.width = x.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        r = get_tensor_model_parallel_rank()
        return g[..., r * ctx.width:(r + 1) * ctx.width].contiguous()


def _shard(full: Tensor | None, dim: int) -> Tensor | None:
    if full is None:
        return None
    n, r = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    if full.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {full.shape[dim]} across {n} tensor-parallel ranks")
    size = full.shape[dim] // n
    return full.narrow(dim, r * size, size).clone()


def _local_parts(parts: int) -> int:
    n = get_tensor_model_parallel_world_size()
    if parts % n:
        raise ValueError(f"tensor-parallel size {n} does not divide the layer's {parts} reduction parts")
    return parts // n


class ColumnParallelLinear(Linear):
    """y = x @ W.T + b with W's output rows split across ranks. gather_output concatenates the
    slices; otherwise each rank keeps its slice (the input of a RowParallelLinear). `parts`: the
    split of the input gradient's reduction over the outputs at every tensor-parallel size."""

    sharded_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = True,
                 weight: Tensor | None = None, bias_value: Tensor | None = None, parts: int | None = None):
        n = get_tensor_model_parallel_world_size()
        if out_features % n:
            raise ValueError(f"out_features: expected a multiple of the tensor-parallel size {n}, got {out_features}")
        super().__init__(in_features, out_features // n, bias, split_n=_local_parts(parts or n))
        full_w = weight if weight is not None else torch.randn(out_features, in_features) * in_features ** -0.5
        full_b = bias_value if bias_value is not None else (torch.zeros(out_features) if bias else None)
        with torch.no_grad():
            self.weight.copy_(_shard(full_w, 0))
            if bias:
                self.bias.copy_(_shard(full_b, 0))
        self.gather_output = gather_output

    def forward(self, x: Tensor) -> Tensor:
        y = ops.linear(_CopyToTP.apply(x, self.split_n), self.weight, self.bias, split_n=self.split_n)
        return _GatherFromTP.apply(y) if self.gather_output else y


class RowParallelLinear(Linear):
    """y = x @ W.T + b with W's input columns split across ranks; the partial products complete
    the canonical tree over `parts` parts of K across the ranks, then the (replicated) bias is added."""

    sharded_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False,
                 weight: Tensor | None = None, bias_value: Tensor | None = None, parts: int | None = None):
        n = get_tensor_model_parallel_world_size()
        if in_features % n:
            raise ValueError(f"in_features: expected a multiple of the tensor-parallel size {n}, got {in_features}")
        super().__init__(in_features // n, out_features, bias, split_k=_local_parts(parts or n))
        full_w = weight if weight is not None else torch.randn(out_features, in_features) * in_features ** -0.5
        with torch.no_grad():
            self.weight.copy_(_shard(full_w, 1))
            if bias:
                self.bias.copy_(bias_value if bias_value is not None else torch.zeros(out_features))
        self.input_is_parallel = input_is_parallel

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            r, n = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            width = x.shape[-1] // n
            x = x[..., r * width:(r + 1) * width]
        y = _ReduceFromTP.apply(ops.linear(x, self.weight, None, split_k=self.split_k), self.split_k)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across ranks; each id is looked up by its owner and the
    rest contribute exact zeros to the sum."""

    def __init__(self, num_embeddings: int, embedding_dim: int, weight: Tensor | None = None):
        super().__init__()
        n, r = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        if num_embeddings % n:
            raise ValueError(f"num_embeddings: expected a multiple of the tensor-parallel size {n}, got {num_embeddings}")
        full = weight if weight is not None else torch.randn(num_embeddings, embedding_dim)
        self.weight = nn.Parameter(_shard(full, 0))
        self.start, self.size = r * (num_embeddings // n), num_embeddings // n

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.size)
        out = ops.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        out = torch.where(inside[..., None], out, torch.zeros_like(out))
        return _ReduceFromTP.apply(out, 1)


def tensor_parallel(model) -> nn.Module:
    """Shard a lockstep Transformer's attention heads and MLP across the tensor-parallel group.

    q/k/v and gate/up become column-parallel (heads and intermediate units split); o and down
    become row-parallel. Embeddings, norms and the LM head stay replicated. Every reduction the
    split shards keeps the model's `tp_split` parts, so logprobs and gradients are those of the
    unsplit model, bit for bit; the tensor-parallel size must divide that number. Every rank must
    pass the same full model; each keeps its shard."""
    from .model.transformer import MLP, Attention

    n = get_tensor_model_parallel_world_size()
    c = model.config
    parts = tp_split(c)
    if parts % n:
        raise ValueError(f"tensor-parallel size {n}: expected a divisor of {parts}, the parts this model's heads "
                         f"({c.num_heads} query, {c.num_kv_heads} KV) and MLP width ({c.intermediate_size}) split into")
    local = dataclasses.replace(c, num_heads=c.num_heads // n, num_kv_heads=c.num_kv_heads // n,
                                intermediate_size=c.intermediate_size // n)

    def column(old, bias: bool) -> ColumnParallelLinear:
        return ColumnParallelLinear(old.weight.shape[1], old.weight.shape[0], bias, gather_output=False,
                                    weight=old.weight.detach(), bias_value=old.bias.detach() if bias else None,
                                    parts=parts).to(old.weight.dtype)

    def row(old) -> RowParallelLinear:
        return RowParallelLinear(old.weight.shape[1], old.weight.shape[0], False, input_is_parallel=True,
                                 weight=old.weight.detach(), parts=parts).to(old.weight.dtype)

    for module in model.modules():
        if isinstance(module, Attention):
            module.c = local
            if c.qk_norm:
                # Replicated weights applied to this rank's heads only: outside a unit tree their
                # gradient is a partial sum, completed here. Inside one, the ops keep the heads apart
                # and lockstep.grad_tree.combine gathers them (Parallel.gather_rows).
                for p in (module.q_norm.weight, module.k_norm.weight):
                    p.register_hook(lambda g: None if g is None else tree_all_reduce(g, get_tensor_model_parallel_group()))
            for proj in ("q_proj", "k_proj", "v_proj"):
                setattr(module, proj, column(getattr(module, proj), c.qkv_bias))
            module.o_proj = row(module.o_proj)
        elif isinstance(module, MLP):
            module.gate_proj = column(module.gate_proj, False)
            module.up_proj = column(module.up_proj, False)
            module.down_proj = row(module.down_proj)
    return model


def head_norms(model: nn.Module) -> set[str]:
    """Names of the weights applied per head (q and k norms): tensor parallelism splits their rows."""
    from .model.transformer import Attention

    return {f"{prefix}.{norm}.weight" for prefix, m in model.named_modules() if isinstance(m, Attention)
            for norm in ("q_norm", "k_norm") if hasattr(m, norm)}


def reduction_parts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{parameter name: (dim, parts)}: the parameters whose gradient norm is summed in parts along a
    dimension that tensor parallelism shards (this rank's parts of it), so that every
    tensor-parallel size sums the same parts. The rest are replicated."""
    out = {}
    for prefix, m in model.named_modules():
        if not isinstance(m, Linear):
            continue
        dim = getattr(m, "sharded_dim", None)
        if dim is None:
            dim = 0 if m.split_n > 1 else 1 if m.split_k > 1 else None
        if dim is None:
            continue
        parts = m.split_n if dim == 0 else m.split_k
        out[f"{prefix}.weight" if prefix else "weight"] = (dim, parts)
        if m.bias is not None and dim == 0:
            out[f"{prefix}.bias" if prefix else "bias"] = (0, parts)
    return out


@contextlib.contextmanager
def distributed_env() -> object:
    """`with distributed_env():` initialise from torchrun's environment and tear down after."""
    started = init_from_env()
    try:
        yield started
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The trainer's view of a parallel layout
# --------------------------------------------------------------------------------------------
def share_of(units: int, rank: int, ranks: int) -> tuple[int, int]:
    """The contiguous run [start, stop) of `units` that data-parallel rank `rank` of `ranks` holds:
    the first units % ranks ranks hold one more."""
    base, extra = divmod(units, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class Parallel:
    """Data and tensor parallelism for lockstep.train.Trainer (its `sync`): which units this rank
    runs, how the data-parallel ranks complete the unit trees, and the gathers that tensor
    parallelism needs. Call after `initialize_model_parallel` (or without it: pure data parallel)
    and `tensor_parallel`."""

    def __init__(self, model: nn.Module):
        self.dp_group = _DP_GROUP
        self.tp_group = _TP_GROUP if _tp_size() > 1 else None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        self.tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        self.tp_size = _tp_size()
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
        dp_groups = [list(range(offset, world, tp)) for offset in range(tp)] if _DP_GROUP is not None \
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
        dist.all_gather_single(done, tree.total().contiguous(), group=self.dp_group)
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

    def barrier(self) -> None:
        dist.barrier()

    def all_same(self, t: Tensor) -> bool:
        """Whether every rank of the world holds the same bits of t."""
        return all_equal(t)[0]
