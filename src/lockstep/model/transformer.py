"""A decoder-only transformer (Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma 3) built only from lockstep.ops.

Parameter names follow Hugging Face (`model.layers.3.mlp.down_proj.weight`), so checkpoints load
without renaming. There are two forward paths with one set of ops: `forward` over packed sequences
(training, recomputing logprobs) and `forward_cached` over a paged KV cache (the engine: prefill
chunks and decode tokens of many sequences in one call). Attention's split invariance makes the two
give the same bits for the same token.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import checks, ops
from ..numerics import grad_tree
from ..numerics.exact_math import normal
from ..numerics.fixed_order import TP_SPLIT, accumulate_dtype
from ..paged_cache import CacheStep
from ..rotary import Positions, Rotation
from ..numerics.softcap import softcap
from ..registry import cpu_backend_kernel_set
from .config import ModelConfig
from .files import write_folder
from .moe import SparseMoE
from .modules import Linear, RMSNorm, add_norm, plain, project


def tp_split(c: ModelConfig) -> int:
    """The parts each reduction that tensor parallelism may shard is cut into: TP_SPLIT, or the
    largest power of two below it that divides the heads, the KV heads and the MLP widths (dense and
    expert). The model computes in these parts at every tensor-parallel size, which must divide it
    (docs/adr/0007)."""
    parts = TP_SPLIT
    widths = [c.num_heads, c.num_kv_heads, c.intermediate_size] + ([c.moe_intermediate_size] if c.num_experts else [])
    while parts > 1 and any(w % parts for w in widths):
        parts //= 2
    return parts


class Attention(nn.Module):
    """Causal GQA attention of one layer: its window and rotary embedding come from the config."""

    def __init__(self, c: ModelConfig, layer: int = 0):
        super().__init__()
        self.c = c
        self.window = c.window(layer)
        self.rope_theta, self.rope_scaling = c.rope_of(layer)
        parts = tp_split(c)
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, c.qkv_bias, split_n=parts)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, split_n=parts)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, split_n=parts)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, False, split_k=parts)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset)

    def qkv(self, x: Tensor, positions: Tensor | Positions | None) -> tuple[Tensor, Tensor, Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of x [T, hidden]: projected, normed (Qwen3, Gemma 3) and
        rotated; not rotated where positions is None (for an op that rotates them itself)."""
        c = self.c
        t = x.shape[0]
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = q.view(t, c.num_heads, c.head_dim), k.view(t, c.num_kv_heads, c.head_dim), v.view(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if positions is None:
            return q, k, v
        q = ops.rope(q, positions, self.rope_theta, c.rope_style, self.rope_scaling)
        k = ops.rope(k, positions, self.rope_theta, c.rope_style, self.rope_scaling)
        return q, k, v

    def forward(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor) -> Tensor:
        q, k, v = self.qkv(x, positions)
        out = ops.attention(q, k, v, cu_seqlens, cu_seqlens, scale=self.c.attn_scale, window=self.window)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def forward_cached(self, x: Tensor, positions: Tensor, step: "CacheStep", k_cache: Tensor, v_cache: Tensor) -> Tensor:
        q, k, v = self.qkv(x, None)
        rotation = Rotation(positions, self.rope_theta, self.c.rope_style, self.rope_scaling)
        out = ops.cached_attention(q, k, v, k_cache, v_cache, step, scale=self.c.attn_scale, window=self.window,
                                   rope=rotation)
        return self.o_proj(out.reshape(x.shape[0], -1))


ACTIVATIONS = {"silu": ops.silu_mul, "gelu_tanh": ops.gelu_mul}


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act from the config (SwiGLU or GeGLU)."""

    def __init__(self, c: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        parts = tp_split(c)
        width = c.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = Linear(c.hidden_size, width, False, split_n=parts)
        self.up_proj = Linear(c.hidden_size, width, False, split_n=parts)
        self.down_proj = Linear(width, c.hidden_size, False, split_k=parts)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(*project(x, (self.gate_proj, self.up_proj))))


class Block(nn.Module):
    """One decoder layer. Gemma's sandwich norms wrap attention and MLP outputs before the residual add."""

    def __init__(self, c: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        if c.is_moe(layer):
            self.mlp = SparseMoE(Linear(c.hidden_size, c.num_experts, False),
                                 [MLP(c, c.moe_intermediate_size) for _ in range(c.num_experts)],
                                 c.num_experts_per_tok, c.norm_topk_prob)
        else:
            self.mlp = MLP(c)
        self.sandwich = c.sandwich_norms

    def stream(self, x: Tensor, delta: Tensor | None, attend) -> tuple[Tensor, Tensor]:
        """The layer on the residual stream x + delta (x alone where delta is None), returned as the
        stream before its last add: the layer's output is the first plus the second. Each add and
        the RMSNorm after it are one `add_norm`; the next layer, or the final norm, makes the last.
        attend: the attention of the normed input (packed or through the cache)."""
        x, h = add_norm(x, delta, self.input_layernorm)
        a = attend(h)
        if self.sandwich:
            x, h = add_norm(x, self.post_attention_layernorm(a), self.pre_feedforward_layernorm)
            return x, self.post_feedforward_layernorm(self.mlp(h))
        x, h = add_norm(x, a, self.post_attention_layernorm)
        return x, self.mlp(h)

    def forward(self, x: Tensor, positions: Tensor, cu_seqlens: Tensor) -> Tensor:
        """The layer's output [T, hidden] over packed sequences."""
        x, delta = self.stream(x, None, lambda h: self.self_attn(h, positions, cu_seqlens))
        return x + delta

    def forward_cached(self, x: Tensor, positions: Tensor, step: "CacheStep", k_cache: Tensor,
                       v_cache: Tensor) -> Tensor:
        """The layer's output [T, hidden] for a step's new tokens through the paged cache."""
        x, delta = self.stream(x, None, lambda h: self.self_attn.forward_cached(h, positions, step, k_cache, v_cache))
        return x + delta


@functools.cache
def _embed_scale(hidden: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Gemma's embedding scale, sqrt(hidden) rounded to fp32 (IEEE, unlike pow) and then to `dtype`:
    one tensor per dtype and device, made once (so that a captured step reads it rather than
    making a tensor of a Python value; engine/step_graph.py)."""
    with torch.inference_mode(False):     # a tensor a later training step may save for backward
        return torch.tensor(math.sqrt(hidden), dtype=torch.float32).to(dtype=dtype, device=device)


class Decoder(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)


@dataclass
class KVCache:
    """Per-layer paged caches [num_blocks, block_size, kv_heads, head_dim] (docs/adr/0003)."""

    k: list[Tensor]
    v: list[Tensor]


def _read_once(positions: Tensor) -> Tensor | Positions:
    """Int positions [T] as a rotary.Positions, read from the device once for all layers; anything
    else is left for ops.rope to refuse with its own message."""
    if isinstance(positions, Tensor) and positions.dim() == 1 and positions.dtype in (torch.int64, torch.int32):
        return Positions.read(positions)
    return positions


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
        """Random weights (normal, std 0.02; norms at 1), the same bits for a given seed on every
        machine: exact_math.normal's draws, not torch.randn's, whose vector and scalar samplers
        give other normals (ADR 0021). Parameters draw in named_parameters order from one
        generator; each is 0.02 x its draws in float64, rounded to float32 and then to `dtype`, so
        a model in another dtype is the float32 one cast."""
        model = cls(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0 - config.norm_offset)
                else:
                    p.copy_(normal(p.shape, gen, scale=0.02, dtype=torch.float32))
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
    def embed(self, input_ids: Tensor, ids_checked: bool = False) -> Tensor:
        """Token embeddings [T, hidden]; Gemma's are scaled by sqrt(hidden_size) rounded to the model's
        dtype, as transformers does. ids_checked: the caller checked on the host that every id is
        below the vocabulary (see ops.embedding), so they are not read back from the device."""
        if ids_checked:
            checks.int_tensor("input_ids", input_ids)
            checks.ndim("input_ids", input_ids, 1, "a 1-D tensor of packed token ids [T]")
        else:
            self._check_ids(input_ids)
        x = ops.embedding(input_ids, self.model.embed_tokens.weight, ids_checked=ids_checked)
        if self.config.embed_scale:
            x = x * _embed_scale(self.config.hidden_size, x.dtype, x.device)
        return x

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
        positions = _read_once(positions)
        delta = None
        for layer in self.model.layers:
            if torch.is_grad_enabled() or not plain(layer, Block):    # the trainer, a hooked layer: as a module
                x = layer(x if delta is None else x + delta, positions, cu_seqlens)
                delta = None
            else:
                x, delta = layer.stream(x, delta, lambda h, layer=layer: layer.self_attn(h, positions, cu_seqlens))
        return add_norm(x, delta, self.model.norm)[1]

    def forward_cached(self, input_ids: Tensor, positions: Tensor, step: CacheStep, cache: KVCache) -> Tensor:
        """Final hidden states [T, hidden] of new tokens, attending through the paged cache.

        Prefill chunks and decode tokens of different sequences can share one call. A step made by
        paged_cache.build_step (with the tokens, as the engine makes it) is run from its checked
        host copy, reading nothing back from the device; a step made by hand is checked by reading
        it (input_ids [T] int, positions [T] int, cache from allocate_kv_cache)."""
        host = step.host
        x = self.embed(input_ids, ids_checked=host is not None and input_ids is host.input_ids
                       and host.vocab_size == self.config.vocab_size)
        positions = host.positions if host is not None and positions is host.positions.tensor else _read_once(positions)
        delta = None
        for layer, k_cache, v_cache in zip(self.model.layers, cache.k, cache.v):
            x, delta = layer.stream(x, delta, lambda h, layer=layer, k_cache=k_cache, v_cache=v_cache:
                                    layer.self_attn.forward_cached(h, positions, step, k_cache, v_cache))
        return add_norm(x, delta, self.model.norm)[1]

    def logits(self, input_ids: Tensor, cu_seqlens: Tensor, positions: Tensor | None = None) -> Tensor:
        """[T, vocab] logits in the model's dtype, softcapped when the config says so (materialised;
        prefer `lockstep.logprobs`)."""
        logits = ops.linear(self(input_ids, cu_seqlens, positions), self.lm_head_weight)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        capped, _ = softcap(logits.to(accumulate_dtype(logits.dtype)), cap, kernels=cpu_backend_kernel_set())
        return capped.to(logits.dtype)

    def selected_logprobs(self, hidden: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
        """ops.selected_logprobs through this model's LM head (and its final-logit softcapping):
        hidden [..., H], targets [...] int -> [...] float32."""
        return ops.selected_logprobs(hidden, self.lm_head_weight, targets, temperature,
                                     softcap=self.config.final_logit_softcapping)

    def vocab_logprobs(self, hidden: Tensor, temperature: float = 1.0) -> Tensor:
        """ops.vocab_logprobs through this model's LM head: hidden [..., H] -> [..., V] float32."""
        return ops.vocab_logprobs(hidden, self.lm_head_weight, temperature, softcap=self.config.final_logit_softcapping)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """The paged cache, uninitialised. Every reader reads only the slots below its sequence's
        length, which its steps have written; a block handed back holds a finished sequence's values
        anyway, so zero-filling would be a full pass over every layer's cache for nothing.
        tests/test_engine.py fills the cache with NaN and checks that no bit changes."""
        c = self.model.layers[0].self_attn.c           # this rank's heads under tensor parallelism
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        make = lambda: torch.empty(shape, dtype=self.dtype, device=self.device)  # noqa: E731
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


# Rows per vocab_logprobs call when packed_logprobs adds the entropy: it bounds the [rows, V] float32
# logprobs held at once, and any split gives the same bits (vocab_logprobs is batch invariant).
ENTROPY_ROWS = 256


def token_entropy(vocab_logprobs: Tensor) -> Tensor:
    """The entropy of each row's next-token distribution from its logprobs over the whole vocabulary
    (-inf where a token has probability 0): [..., V] float -> [...] of the same dtype."""
    return -(vocab_logprobs.exp() * torch.where(torch.isfinite(vocab_logprobs), vocab_logprobs, 0.0)).sum(-1)


def packed_logprobs(model: Transformer, sequences: list, temperature: float = 1.0, first_unit: int = 0,
                    entropy: bool = False) -> tuple[Tensor, ...]:
    """The logprob of every token after the first of each sequence, from one packed forward and
    `selected_logprobs` (the full logits only for a few rows): float32 [sum(len_i - 1)], sequence by sequence, and
    the target ids int64 [sum(len_i - 1)]. Differentiable. temperature scales the logits as the
    engine's sampler did. With entropy=True, a third tensor: the entropy of each of those rows'
    next-token distribution at temperature (`token_entropy` of `vocab_logprobs`), float32
    [sum(len_i - 1)], without gradient.

    Inside a unit tree (lockstep.numerics.grad_tree), sequence i is unit first_unit + i, so the backward
    pass keeps each sequence's weight gradients apart; outside one, first_unit does nothing."""
    ids, cu = pack(sequences, model.device)
    with grad_tree.unit_rows(cu, first_unit):
        hidden = model(ids, cu)
    keep = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    keep[cu[1:] - 1] = False                     # the last token of a sequence predicts nothing
    rows = torch.nonzero(keep)[:, 0]
    targets = ids[rows + 1]
    kept = cu - torch.arange(cu.numel(), device=cu.device)       # sequence i keeps len_i - 1 rows
    with grad_tree.unit_rows(kept, first_unit):
        lp = model.selected_logprobs(hidden[rows], targets, temperature=temperature)
    if not entropy:
        return lp, targets
    with torch.no_grad():
        ent = torch.cat([token_entropy(model.vocab_logprobs(h, temperature)) for h in hidden[rows].split(ENTROPY_ROWS)])
    return lp, targets, ent


def logprobs(model: Transformer, sequences: list, temperature: float = 1.0) -> list[Tensor]:
    """Per-token logprobs of each sequence: entry t-1 is log p(token t | tokens < t), float32.

    `packed_logprobs`, split: a list of [len - 1] tensors, one per sequence; differentiable."""
    lp, _ = packed_logprobs(model, sequences, temperature)
    return list(torch.split(lp, [len(s) - 1 for s in sequences]))
