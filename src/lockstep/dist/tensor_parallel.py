"""lockstep.dist.tensor_parallel: Megatron-style column- and row-parallel linears, a vocabulary-parallel
embedding and `tensor_parallel(model)`, which splits attention heads and the MLP across ranks.

Every reduction the split shards runs in `TP_SPLIT` parts at every size (the model's split_k and
split_n); a rank computes its run of parts and `tree_all_reduce` completes the tree across the
ranks, so logprobs and gradients are those of one process.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import ops
from ..model.transformer import Linear, tp_split
from .collectives import group_size, tree_all_reduce

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


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(get_tensor_model_parallel_group())


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(get_tensor_model_parallel_group())


def tensor_parallel_size() -> int:
    """The tensor-parallel size: 1 before (or without) initialize_model_parallel."""
    return dist.get_world_size(_TP_GROUP) if _TP_GROUP is not None else 1


def model_parallel_groups() -> tuple:
    """(tensor-parallel group, data-parallel group) of this rank; (None, None) before
    initialize_model_parallel (pure data parallel over the world)."""
    return _TP_GROUP, _DP_GROUP


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
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
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
    from ..model.transformer import MLP, Attention

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
                # and lockstep.numerics.grad_tree.combine gathers them (Parallel.gather_rows).
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
    from ..model.transformer import Attention

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
