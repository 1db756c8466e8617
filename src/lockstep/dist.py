"""lockstep.dist: data and tensor parallelism on torch.distributed, with fixed-order reductions.

Every sum across ranks is computed by one owner in rank order (((r0 + r1) + r2) + ...), and the
result is copied to the others. So every rank holds the same bits, and the bits depend on neither
message sizes, nor the collective algorithm, nor timing (docs/contract.md, section 5).

- Data parallel: `GradReducer` buckets the gradients. Each bucket is split into one shard per rank;
  the owner of a shard receives it from every rank (all_to_all), adds the contributions in rank
  order, and the reduced shards are all-gathered. A bucket's communication starts as soon as its
  gradients are final (a post-accumulate hook), overlapping the rest of the backward. With one
  micro-batch per rank, N ranks are bitwise identical to one process accumulating the same N
  micro-batches in rank order: autograd's accumulation is the same left-to-right sum.
- Tensor parallel: Megatron-style column- and row-parallel linears and a vocabulary-parallel
  embedding. Attention heads and the MLP are split across ranks; the row-parallel all-reduce
  gathers the partial sums and adds them in rank order on every rank.
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
from .fixed_order import ceil_div

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
# Fixed-order collectives
# --------------------------------------------------------------------------------------------
def _ranks(group) -> int:
    return dist.get_world_size(group)


def fixed_order_all_reduce(t: Tensor, group=None) -> Tensor:
    """Sum of `t` over the group's ranks, added in rank order on every rank (identical bits)."""
    n = _ranks(group)
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


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


class GradReducer:
    """Fixed-order, sharded gradient reduction over a data-parallel group, in buckets.

    `arm()` before the last backward of a window; each bucket then starts its all_to_all as soon as
    all of its gradients are final, in bucket order. `finish()` launches what is left, adds each
    shard's contributions in rank order, all-gathers the shards and writes the sums into .grad."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], group=None, bucket_numel: int = 1 << 20):
        self.group = group
        self.world = _ranks(group)
        params = [p for _, p in sorted(named_params, key=lambda kv: kv[0]) if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        current, size = [], 0
        for p in reversed(params):              # roughly the order in which backward finishes them
            current.append(p)
            size += p.numel()
            if size >= bucket_numel:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.armed = False
        self._ready = [0] * len(self.buckets)
        self._inflight: dict[int, tuple] = {}
        self._next = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def arm(self) -> None:
        self.armed = True
        self._ready = [0] * len(self.buckets)
        self._inflight, self._next = {}, 0

    def _hook(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        b = self.bucket_of[id(p)]
        self._ready[b] += 1
        # Launch in bucket order only, so every rank issues the same collectives in the same order.
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        shard = ceil_div(flat.numel(), self.world)
        padded = torch.zeros(shard * self.world, dtype=flat.dtype)
        padded[:flat.numel()] = flat
        recv = torch.empty_like(padded)
        work = dist.all_to_all_single(recv, padded, group=self.group, async_op=True)
        self._inflight[b] = (work, recv, shard, flat.numel())

    def finish(self) -> None:
        if not self.armed:
            self.arm()
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for b, params in enumerate(self.buckets):
            work, recv, shard, numel = self._inflight[b]
            work.wait()
            parts = recv.view(self.world, shard)
            total = parts[0]
            for r in range(1, self.world):
                total = total + parts[r]                   # rank order: ((r0 + r1) + r2) + ...
            gathered = [torch.empty_like(total) for _ in range(self.world)]
            dist.all_gather(gathered, total, group=self.group)
            flat = torch.cat(gathered)[:numel]
            offset = 0
            for p in params:
                n = p.numel()
                value = flat[offset:offset + n].view(p.shape).to(p.dtype)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
                offset += n
        self.armed = False


# --------------------------------------------------------------------------------------------
# Data-parallel training
# --------------------------------------------------------------------------------------------
class DataParallelTrainer:
    """A lockstep Trainer over a data-parallel group: each rank runs its micro-batches of every
    global window (rank r takes micro-batches r*K .. r*K + K - 1), gradients are reduced in fixed
    order, and every rank takes the same optimizer step."""

    def __init__(self, trainer, group=None):
        from .train import Trainer

        assert isinstance(trainer, Trainer)
        self.t, self.group = trainer, group
        self.rank, self.world = dist.get_rank(group), _ranks(group)
        trainer.layout = {"data_parallel": self.world,
                          "tensor_parallel": dist.get_world_size(_TP_GROUP) if _TP_GROUP is not None else 1}
        check_consistent(trainer.model, dataclasses.asdict(trainer.cfg) | {"model": repr(trainer.model.config)}, group)
        self.reducer = GradReducer(trainer.named, group)

    def step(self) -> dict:
        import math

        from .train import NonFiniteLoss, cross_entropy_sum, grad_norm, lr_at

        t, k = self.t, self.t.cfg.accum
        window = [t.data.next_batch() for _ in range(k * self.world)]     # the same global window everywhere
        mine = window[self.rank * k:(self.rank + 1) * k]
        local_tokens = sum(s.numel() - 1 for mb in mine for s in mb)
        counts = fixed_order_all_reduce(torch.tensor([float(local_tokens)], dtype=torch.float64), self.group)
        total_tokens = int(counts[0])
        for _, p in t.named:
            p.grad = None
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for i, mb in enumerate(mine):
            if i == len(mine) - 1:
                self.reducer.arm()
            loss, _ = cross_entropy_sum(t.model, mb)
            (loss / total_tokens).backward()
            loss_sum += float(loss.detach())
        self.reducer.finish()
        loss_value = float(fixed_order_all_reduce(loss_sum, self.group)[0]) / total_tokens
        if not math.isfinite(loss_value):
            raise NonFiniteLoss(f"non-finite loss {loss_value} at step {t.step_idx} (data epoch {t.data.epoch}, "
                                f"sequence index {t.data.index})")
        norm = grad_norm(t.named)
        scale = t.cfg.grad_clip / (float(norm) + 1e-6) if t.cfg.grad_clip > 0 and float(norm) > t.cfg.grad_clip else 1.0
        lr = lr_at(t.step_idx, t.cfg.lr, t.cfg.warmup, t.cfg.steps, t.cfg.min_lr_ratio)
        t.opt.step(lr, grad_scale=scale)
        t.step_idx += 1
        return {"step": t.step_idx, "loss": loss_value, "grad_norm": float(norm), "lr": lr, "tokens": total_tokens}

    def params_identical(self) -> tuple[bool, int]:
        """Promise 1: compare a digest of all parameters across ranks; also the number compared."""
        return all_equal(params_digest(self.t.model), self.group)

    def save(self, out_dir: str) -> None:
        """Pure data parallelism: rank 0 writes one ordinary checkpoint (every rank holds the same
        bits). With tensor parallelism: one file per rank (`save_checkpoint`)."""
        if _TP_GROUP is not None and dist.get_world_size(_TP_GROUP) > 1:
            save_checkpoint(self.t, out_dir)
            return
        if self.rank == 0:
            self.t.save(out_dir)
        dist.barrier(self.group)

    def resume(self, out_dir: str) -> int:
        if _TP_GROUP is not None and dist.get_world_size(_TP_GROUP) > 1:
            return resume_checkpoint(self.t, out_dir)
        return self.t.resume(out_dir)


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
    if not isinstance(tp, int) or tp < 1 or world % tp:
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


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the partial input gradients of the ranks in fixed order."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return fixed_order_all_reduce(g.contiguous(), get_tensor_model_parallel_group())


class _ReduceFromTP(torch.autograd.Function):
    """Forward sums the ranks' partial outputs in fixed order; backward is the identity."""

    @staticmethod
    def forward(ctx, x):
        return fixed_order_all_reduce(x, get_tensor_model_parallel_group())

    @staticmethod
    def backward(ctx, g):
        return g


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


def _mark_sharded(*params) -> None:
    """Parameters that hold a slice on each tensor-parallel rank (the rest are replicated)."""
    for p in params:
        if p is not None:
            p._lockstep_tp_sharded = True


def tp_sum(t: Tensor) -> Tensor:
    """Sum of a per-rank partial over the tensor-parallel group (fixed order); t itself when TP is off."""
    if _TP_GROUP is None or dist.get_world_size(_TP_GROUP) == 1:
        return t
    return fixed_order_all_reduce(t, _TP_GROUP)


def _shard(full: Tensor | None, dim: int) -> Tensor | None:
    if full is None:
        return None
    n, r = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    if full.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {full.shape[dim]} across {n} tensor-parallel ranks")
    size = full.shape[dim] // n
    return full.narrow(dim, r * size, size).clone()


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T + b with W's output rows split across ranks. gather_output concatenates the
    slices; otherwise each rank keeps its slice (the input of a RowParallelLinear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = True,
                 weight: Tensor | None = None, bias_value: Tensor | None = None):
        super().__init__()
        n = get_tensor_model_parallel_world_size()
        if out_features % n:
            raise ValueError(f"out_features: expected a multiple of the tensor-parallel size {n}, got {out_features}")
        full_w = weight if weight is not None else torch.randn(out_features, in_features) * in_features ** -0.5
        self.weight = nn.Parameter(_shard(full_w, 0))
        full_b = bias_value if bias_value is not None else (torch.zeros(out_features) if bias else None)
        self.bias = nn.Parameter(_shard(full_b, 0)) if bias else None
        self.gather_output = gather_output
        _mark_sharded(self.weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        y = ops.linear(_CopyToTP.apply(x), self.weight, self.bias)
        return _GatherFromTP.apply(y) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x @ W.T + b with W's input columns split across ranks; partial products are summed in
    rank order, then the (replicated) bias is added."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False,
                 weight: Tensor | None = None, bias_value: Tensor | None = None):
        super().__init__()
        n = get_tensor_model_parallel_world_size()
        if in_features % n:
            raise ValueError(f"in_features: expected a multiple of the tensor-parallel size {n}, got {in_features}")
        full_w = weight if weight is not None else torch.randn(out_features, in_features) * in_features ** -0.5
        self.weight = nn.Parameter(_shard(full_w, 1))
        self.bias = nn.Parameter(bias_value.clone() if bias_value is not None else torch.zeros(out_features)) if bias else None
        self.input_is_parallel = input_is_parallel
        _mark_sharded(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            r, n = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            width = x.shape[-1] // n
            x = x[..., r * width:(r + 1) * width]
        y = _ReduceFromTP.apply(ops.linear(x, self.weight, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across ranks; each id is looked up by its owner and the
    rest contribute exact zeros to the fixed-order sum."""

    def __init__(self, num_embeddings: int, embedding_dim: int, weight: Tensor | None = None):
        super().__init__()
        n, r = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        if num_embeddings % n:
            raise ValueError(f"num_embeddings: expected a multiple of the tensor-parallel size {n}, got {num_embeddings}")
        full = weight if weight is not None else torch.randn(num_embeddings, embedding_dim)
        self.weight = nn.Parameter(_shard(full, 0))
        self.start, self.size = r * (num_embeddings // n), num_embeddings // n
        _mark_sharded(self.weight)

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.size)
        out = ops.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        out = torch.where(inside[..., None], out, torch.zeros_like(out))
        return _ReduceFromTP.apply(out)


def tensor_parallel(model) -> nn.Module:
    """Shard a lockstep Transformer's attention heads and MLP across the tensor-parallel group.

    q/k/v and gate/up become column-parallel (heads and intermediate units split); o and down
    become row-parallel. Embeddings, norms and the LM head stay replicated. Every rank must pass
    the same full model; each keeps its shard."""
    from .model.transformer import MLP, Attention

    n = get_tensor_model_parallel_world_size()
    c = model.config
    for name, value in (("num_heads", c.num_heads), ("num_kv_heads", c.num_kv_heads),
                        ("intermediate_size", c.intermediate_size)):
        if value % n:
            raise ValueError(f"{name}: {value} is not divisible by the tensor-parallel size {n}")
    local = dataclasses.replace(c, num_heads=c.num_heads // n, num_kv_heads=c.num_kv_heads // n,
                                intermediate_size=c.intermediate_size // n)
    for module in model.modules():
        if isinstance(module, Attention):
            module.c = local
            if c.qk_norm:
                # Replicated weights applied to this rank's heads only: their gradient is a partial
                # sum, completed over the tensor-parallel group in rank order.
                for p in (module.q_norm.weight, module.k_norm.weight):
                    p.register_hook(tp_sum)
            for proj in ("q_proj", "k_proj", "v_proj"):
                old = getattr(module, proj)
                setattr(module, proj, ColumnParallelLinear(old.weight.shape[1], old.weight.shape[0], old.bias is not None,
                                                           gather_output=False, weight=old.weight.detach(),
                                                           bias_value=None if old.bias is None else old.bias.detach()))
            old = module.o_proj
            module.o_proj = RowParallelLinear(old.weight.shape[1], old.weight.shape[0], False, input_is_parallel=True,
                                              weight=old.weight.detach())
        elif isinstance(module, MLP):
            for proj in ("gate_proj", "up_proj"):
                old = getattr(module, proj)
                setattr(module, proj, ColumnParallelLinear(old.weight.shape[1], old.weight.shape[0], False,
                                                           gather_output=False, weight=old.weight.detach()))
            old = module.down_proj
            module.down_proj = RowParallelLinear(old.weight.shape[1], old.weight.shape[0], False, input_is_parallel=True,
                                                 weight=old.weight.detach())
    return model


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
# Checkpoints of distributed runs
# --------------------------------------------------------------------------------------------
def save_checkpoint(trainer, out_dir: str) -> str:
    """Every rank writes its parameters and optimizer state (its shard under tensor parallelism)
    to rank-R.safetensors in a temporary folder; rank 0 adds trainer_state.json, renames the
    folder into place and updates `latest` last. A crash leaves the previous checkpoint in force."""
    import shutil

    from safetensors.torch import save_file

    from .train import model_fingerprint

    rank, world = dist.get_rank(), dist.get_world_size()
    name = f"step-{trainer.step_idx:06d}"
    tmp, final = os.path.join(out_dir, f".tmp-{name}"), os.path.join(out_dir, name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    tensors = {f"param.{n}": p.detach().contiguous() for n, p in trainer.named}
    tensors.update({f"opt.{k}": v.contiguous() for k, v in trainer.opt.state_tensors().items()})
    save_file(tensors, os.path.join(tmp, f"rank-{rank}.safetensors"))
    if rank == 0:
        settings = trainer.settings()
        state = {"step": trainer.step_idx, "data": trainer.data.state(), "rng": trainer.rng.get_state().tolist(),
                 "model_fingerprint": model_fingerprint(trainer.model.config), "world_size": world,
                 "tensor_parallel_size": dist.get_world_size(_TP_GROUP) if _TP_GROUP is not None else 1,
                 "train_config": settings["train_config"], "dtype": settings["dtype"],
                 "data_fingerprint": settings["data"], "layout": settings["layout"]}
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f)
    dist.barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(out_dir, ".latest.tmp"), "w") as f:
            f.write(name)
        os.replace(os.path.join(out_dir, ".latest.tmp"), os.path.join(out_dir, "latest"))
    dist.barrier()
    return final


def resume_checkpoint(trainer, out_dir: str) -> int:
    """Load this rank's file of out_dir/latest; refuses another model or another world layout."""
    from .model.files import read_json, read_tensors
    from .train import latest_checkpoint, model_fingerprint

    path = latest_checkpoint(out_dir)
    state = read_json(os.path.join(path, "trainer_state.json"), "trainer_state.json")
    tp = dist.get_world_size(_TP_GROUP) if _TP_GROUP is not None else 1
    if state.get("model_fingerprint") != model_fingerprint(trainer.model.config):
        raise ValueError(f"resume: checkpoint {path} belongs to another model")
    if state.get("world_size") != dist.get_world_size() or state.get("tensor_parallel_size") != tp:
        raise ValueError(f"resume: checkpoint {path} was written by {state.get('world_size')} ranks with tensor-parallel "
                         f"size {state.get('tensor_parallel_size')}; this run has {dist.get_world_size()} and {tp}")
    trainer.resumed_changes = trainer.changes_from(state, path)
    tensors = read_tensors(os.path.join(path, f"rank-{dist.get_rank()}.safetensors"))
    with torch.no_grad():
        for n, p in trainer.named:
            p.copy_(tensors[f"param.{n}"])
    trainer.opt.load_state_tensors({k[4:]: v for k, v in tensors.items() if k.startswith("opt.")}, state["step"])
    trainer.data.load_state(state["data"])
    trainer.rng.set_state(torch.tensor(state["rng"], dtype=torch.uint8))
    trainer.step_idx = state["step"]
    return trainer.step_idx
