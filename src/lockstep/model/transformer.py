"""A decoder-only transformer (Llama, Qwen2, Qwen3) built only from lockstep.ops.

Parameter names follow Hugging Face (`model.layers.3.mlp.down_proj.weight`), so checkpoints load
without renaming. There are two forward paths with one set of ops: `forward` over packed sequences
(training, recomputing logprobs) and `forward_cached` over a paged KV cache (the engine: prefill
chunks and decode tokens of many sequences in one call). Attention's split invariance makes the two
give the same bits for the same token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import checks, ops
from ..fixed_order import TP_SPLIT
from ..paged_cache import CacheStep
from .config import ModelConfig
from .files import write_folder


def tp_split(c: ModelConfig) -> int:
    """The parts each reduction that tensor parallelism may shard is cut into: TP_SPLIT, or the
    largest power of two below it that divides the heads, the KV heads and the MLP width. The model
    computes in these parts at every tensor-parallel size, which must divide it (docs/adr/0007)."""
    parts = TP_SPLIT
    while parts > 1 and (c.num_heads % parts or c.num_kv_heads % parts or c.intermediate_size % parts):
        parts //= 2
    return parts


class Linear(nn.Module):
    """ops.linear with this layer's split of its reductions: split_n for a layer whose output
    tensor parallelism shards (column-parallel), split_k for one whose input it shards (row-parallel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, split_k: int = 1, split_n: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.split_k, self.split_n = split_k, split_n

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias, split_k=self.split_k, split_n=self.split_n)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.offset)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        parts = tp_split(c)
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, c.qkv_bias, split_n=parts)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, split_n=parts)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, split_n=parts)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, False, split_k=parts)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset)

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = self.c
        t = x.shape[0]
        q = self.q_proj(x).view(t, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = ops.rope(q, positions, c.rope_theta, c.rope_style, c.rope_scaling)
        k = ops.rope(k, positions, c.rope_theta, c.rope_style, c.rope_scaling)
        return q, k, v

    def forward(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor) -> Tensor:
        q, k, v = self.qkv(x, positions)
        out = ops.attention(q, k, v, cu_seqlens, cu_seqlens)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def forward_cached(self, x: Tensor, positions: Tensor, step: "CacheStep", k_cache: Tensor, v_cache: Tensor) -> Tensor:
        q, k, v = self.qkv(x, positions)
        ops.write_kv(k, v, k_cache, v_cache, step.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, step.block_table, step.seq_lens, step.cu_seqlens_q)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        parts = tp_split(c)
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, False, split_n=parts)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, False, split_n=parts)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, False, split_k=parts)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        self.mlp = MLP(c)

    def forward(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cu_seqlens)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x: Tensor, positions: Tensor, step: "CacheStep", k_cache: Tensor, v_cache: Tensor) -> Tensor:
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), positions, step, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)


@dataclass
class KVCache:
    """Per-layer paged caches [num_blocks, block_size, kv_heads, head_dim] (docs/adr/0003)."""

    k: list[Tensor]
    v: list[Tensor]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]


def positions_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """0, 1, ..., len-1 for each packed sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


class Transformer(nn.Module):
    """Decoder-only LM. `config` holds the family's differences; every op is a lockstep op."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False)
        self.tokenizer = None

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> "Transformer":
        """Random weights (normal, std 0.02; norms at 1), the same for a given seed on any machine."""
        model = cls(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0 - config.norm_offset)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return model.to(device=device, dtype=dtype)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _check_ids(self, input_ids: Tensor) -> None:
        checks.int_tensor("input_ids", input_ids)
        checks.ndim("input_ids", input_ids, 1, "a 1-D tensor of packed token ids [T]")
        checks.in_range("input_ids", input_ids, self.config.vocab_size)

    # --- forward paths ------------------------------------------------------------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        self._check_ids(input_ids)
        return ops.embedding(input_ids, self.model.embed_tokens.weight)

    def forward(self, input_ids: Tensor | None, cu_seqlens: Tensor, positions: Tensor | None = None,
                inputs_embeds: Tensor | None = None) -> Tensor:
        """Final hidden states [T, hidden] of packed sequences.

        input_ids: [T] int (or inputs_embeds [T, hidden]); cu_seqlens: [B + 1] offsets;
        positions: [T] (default 0..len-1 within each sequence)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if cu_seqlens[-1] != x.shape[0]:
            raise ValueError(f"cu_seqlens: expected the last offset to equal the {x.shape[0]} tokens, got {int(cu_seqlens[-1])}")
        given = positions is not None
        if positions is None:
            positions = positions_from_cu_seqlens(cu_seqlens)
        context = self.config.max_position_embeddings
        if positions.numel() and int(positions.max()) >= context:
            if given:
                raise ValueError(f"positions: expected values below the model's context of {context} "
                                 f"(max_position_embeddings), found {int(positions.max())}")
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            worst = max(range(len(lengths)), key=lambda i: lengths[i])
            raise ValueError(f"sequences: sequence {worst} has {lengths[worst]} tokens (position "
                             f"{int(positions.max())}), beyond the model's context of {context} "
                             "(max_position_embeddings)")
        for layer in self.model.layers:
            x = layer(x, positions, cu_seqlens)
        return self.model.norm(x)

    def forward_cached(self, input_ids: Tensor, positions: Tensor, step: CacheStep, cache: KVCache) -> Tensor:
        """Final hidden states [T, hidden] of new tokens, attending through the paged cache.

        Prefill chunks and decode tokens of different sequences can share one call."""
        x = self.embed(input_ids)
        for layer, k_cache, v_cache in zip(self.model.layers, cache.k, cache.v):
            x = layer.forward_cached(x, positions, step, k_cache, v_cache)
        return self.model.norm(x)

    def logits(self, input_ids: Tensor, cu_seqlens: Tensor, positions: Tensor | None = None) -> Tensor:
        """[T, vocab] logits in the model's dtype (materialised; prefer `lockstep.logprobs`)."""
        return ops.linear(self(input_ids, cu_seqlens, positions), self.lm_head_weight)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        c = self.model.layers[0].self_attn.c           # this rank's heads under tensor parallelism
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        make = lambda: torch.zeros(shape, dtype=self.dtype, device=self.device)  # noqa: E731
        return KVCache([make() for _ in range(c.num_layers)], [make() for _ in range(c.num_layers)])

    def save(self, path: str, tensors: dict[str, Tensor] | None = None) -> None:
        """Write config.json and model.safetensors that `load_model` and transformers both read, and
        the tokenizer's files. `tensors` replaces the parameters (whole ones gathered from the
        shards of a tensor-parallel model)."""
        hf = self.config.to_hf()
        hf["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        write_folder(path, tensors if tensors is not None else {n: p.detach() for n, p in self.named_parameters()}, hf)
        if self.tokenizer is not None:
            self.tokenizer.save(path)


def pack(sequences: list, device: str | torch.device = "cpu") -> tuple[Tensor, Tensor]:
    """Token-id sequences -> (input_ids [T] int64, cu_seqlens [B + 1] int64)."""
    ids, cu = [], [0]
    for i, s in enumerate(sequences):
        t = torch.as_tensor(s, device=device).reshape(-1)
        if t.numel() == 0:
            raise ValueError(f"sequences: sequence {i} is empty")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"sequences: sequence {i} holds {t.dtype} values; expected integer token ids")
        t = t.to(torch.int64)
        ids.append(t)
        cu.append(cu[-1] + t.numel())
    if not ids:
        raise ValueError("sequences: expected at least one sequence")
    return torch.cat(ids), torch.tensor(cu, dtype=torch.int64, device=device)


def logprobs(model: Transformer, sequences: list, temperature: float = 1.0) -> list[Tensor]:
    """Per-token logprobs of each sequence: entry t-1 is log p(token t | tokens < t), float32.

    Runs one packed forward and `selected_logprobs` (never the full logits); differentiable.
    temperature scales the logits as the engine's sampler did. Returns a list of [len - 1]
    tensors, one per sequence."""
    ids, cu = pack(sequences, model.device)
    hidden = model(ids, cu)
    starts, ends = cu[:-1], cu[1:]
    keep = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    keep[ends - 1] = False                       # the last token of a sequence predicts nothing
    rows = torch.nonzero(keep)[:, 0]
    targets = ids[rows + 1]
    lp = ops.selected_logprobs(hidden[rows], model.lm_head_weight, targets, temperature=temperature)
    sizes = (ends - starts - 1).tolist()
    return list(torch.split(lp, sizes))
