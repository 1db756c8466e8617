"""Patch a Hugging Face transformers Llama, Qwen2, Qwen3, Qwen3-MoE or Gemma 3 model to run on lockstep ops, in place.

    lockstep.patch(model)      # Linear, RMSNorm, rotary embedding, MLP activation and attention
    lockstep.patch(model, positions_from_mask=True)   # also: padded batches get generate's positions
    ...
    lockstep.unpatch(model)    # restores the original forwards

Like Liger-Kernel's patching, it swaps forwards of module instances and routes attention through
transformers' attention-function registry ("lockstep"). It does not copy an operator; each
swapped forward calls a lockstep op:
- nn.Linear -> ops.linear (fixed row tiles);
- *RMSNorm -> ops.rms_norm (Gemma's in its (1 + weight) form);
- *MLP -> down(ops.silu_mul(gate(x), up(x))), or ops.gelu_mul for Gemma's GeGLU;
- a mixture's router and experts -> lockstep.model.moe's route and run_experts (fixed tie order,
  row-invariant expert GEMMs, a token's expert outputs added in a fixed order);
- rotary embedding -> ops.rope on the position ids (the rotary module passes the positions through,
  and apply_rotary_pos_emb rotates with lockstep's float64 angles);
- attention -> ops.masked_attention: fixed 64-key blocks anchored at each
  query's first visible key, so padding, batching and KV-cache decode change no bit; a
  sliding-window layer's window is applied to the causal mask.
"""

from __future__ import annotations

import importlib
import math
import warnings

import torch
from torch import Tensor, nn

from .. import ops
from ..model.config import FAMILIES as MODEL_FAMILIES
from ..model.config import HF_ACTS
from ..model.moe import route, run_experts
from ..model.transformer import ACTIVATIONS
from ..rotary import RopeScaling, rope_scaling_from_hf

FAMILIES = tuple(MODEL_FAMILIES)
MODULES = {"gemma3_text": "gemma3"}           # model_type -> its package under transformers.models
_ATTN = "lockstep"
_patched_count = 0
_saved_apply: dict[str, object] = {}


class _Positions:
    """What the patched rotary module returns instead of (cos, sin): the position ids themselves,
    and the rotary parameters of the layer type asked for."""

    def __init__(self, position_ids: Tensor, theta: float, scaling: RopeScaling | None):
        self.position_ids, self.theta, self.scaling = position_ids, theta, scaling


def _rope_params(config, layer_type: str | None = None) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of a config, or of one layer type where the parameters are per type (Gemma 3)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = dict(rope[layer_type])
    else:
        rope.update(getattr(config, "rope_scaling", None) or {})
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return theta, rope_scaling_from_hf(rope, "model.config")


def _rotate(x: Tensor, where: _Positions) -> Tensor:
    """x [B, H, T, D], positions [B, T] or [1, T] (shared by the batch) -> x rotated by ops.rope."""
    positions, theta, scaling = where.position_ids, where.theta, where.scaling
    b, h, t, d = x.shape
    positions = positions.expand(b, t)
    flat = x.transpose(1, 2).reshape(b * t, h, d)
    out = ops.rope(flat, positions.reshape(-1).long(), theta=theta, style="neox", scaling=scaling)
    return out.reshape(b, t, h, d).transpose(1, 2)


def _make_apply(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if isinstance(cos, _Positions):
            return _rotate(q, cos), _rotate(k, cos)
        return original(q, k, cos, sin, *args, **kwargs)
    apply_rotary_pos_emb._lockstep = True
    return apply_rotary_pos_emb


def lockstep_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                       dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers attention function: query [B, Hq, Lq, D], key/value [B, Hkv, Lk, D]."""
    from ..mode import visible_mask

    if dropout:
        raise NotImplementedError("lockstep attention: dropout is not supported (train with attention_dropout=0)")
    lq, lk = query.shape[-2], key.shape[-2]
    is_causal = attention_mask is None and getattr(module, "is_causal", True)
    visible = visible_mask(query, key, attention_mask, False)
    if is_causal:                     # bottom-right: the queries are the last lq of lk positions
        pos = torch.arange(lk - lq, lk, device=query.device)[:, None]
        keys = torch.arange(lk, device=query.device)[None, :]
        visible &= keys <= pos
        window = kwargs.get("sliding_window")
        if window:                    # a mask, when given, already holds the window
            visible &= keys > pos - window
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out, _ = ops.masked_attention(query, key, value, visible, scale)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_ATTN, lockstep_attention)
    AttentionMaskInterface.register(_ATTN, sdpa_mask)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids [B, T] from a 0/1 attention mask [B, T], as transformers' `generate` derives them:
    each row counts its own tokens from 0, so a left-padded row starts at 0 where its text does;
    padding positions get 0. Pass them to a training forward so that it sees the positions the
    sampler saw."""
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: expected a 2-D tensor [batch, tokens], got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


_warned_padding = False


def _positions_hook(derive: bool):
    """A forward pre-hook for the decoder: when a padded batch comes without position_ids, derive them
    from the mask (derive=True) or warn once that its rows are shifted by their padding."""
    def hook(module, args, kwargs):
        global _warned_padding
        mask = kwargs.get("attention_mask")
        if kwargs.get("position_ids") is not None or not isinstance(mask, Tensor) or mask.dim() != 2:
            return None
        cache = kwargs.get("past_key_values")
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            return None                             # decoding: the mask covers the cache too
        ids = kwargs.get("input_ids", args[0] if args else None)
        width = ids.shape[1] if isinstance(ids, Tensor) else mask.shape[1]
        if mask.shape[1] != width or bool(mask.all()):
            return None
        if derive:
            return args, {**kwargs, "position_ids": position_ids_from_mask(mask)}
        if not _warned_padding:
            _warned_padding = True
            warnings.warn("lockstep.patch: a padded batch arrived without position_ids; transformers numbers "
                          "every row's tokens 0..T-1, so a left-padded row's positions are shifted by its padding "
                          "and differ from generate's. Pass position_ids=lockstep.integrations.hf.position_ids_from_mask(mask), "
                          "or patch(model, positions_from_mask=True)", stacklevel=2)
        return None
    return hook


def _family(model) -> str:
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"model: lockstep.patch supports transformers {FAMILIES} models, got model_type={family!r}")
    return family


def _modeling(family: str):
    name = MODULES.get(family, family)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _activation(config):
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in HF_ACTS:
        raise ValueError(f"model: lockstep.patch has no invariant MLP activation {act!r} (expected one of "
                         f"{sorted(HF_ACTS)})")
    return ACTIVATIONS[HF_ACTS[act]]


def _norm_forward(m: nn.Module):
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6))
    offset = 1.0 if type(m).__name__.startswith("Gemma") else 0.0     # Gemma scales by (1 + weight)
    return lambda x: ops.rms_norm(x, m.weight, eps=eps, offset=offset)


def _router_forward(m: nn.Module):
    def forward(hidden_states: Tensor):
        logits = ops.linear(hidden_states.reshape(-1, m.hidden_dim), m.weight)
        weights, experts = route(logits, m.top_k, m.norm_topk_prob)
        return logits, weights, experts
    return forward


def _experts_forward(m: nn.Module, act):
    def expert(e: int, rows: Tensor) -> Tensor:
        gate, up = ops.linear(rows, m.gate_up_proj[e]).chunk(2, dim=-1)
        return ops.linear(act(gate.contiguous(), up.contiguous()), m.down_proj[e])

    def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return run_experts(hidden_states, top_k_weights, top_k_index, expert, m.num_experts)
    return forward


def patch(model: nn.Module, positions_from_mask: bool = False) -> nn.Module:
    """Swap the forwards of a transformers Llama/Qwen2/Qwen3/Qwen3-MoE/Gemma 3 model for lockstep ops (in place).

    positions_from_mask: a forward that gets a padded attention_mask and no position_ids uses
    `position_ids_from_mask(attention_mask)`, the positions generate uses (off: such a forward
    warns once)."""
    global _patched_count
    family = _family(model)
    if getattr(model, "_lockstep_patched", False):
        return model
    config = model.config
    act = _activation(config)
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise ValueError("model: lockstep.patch does not reach the final-logit softcapping that the causal-LM "
                         "forward applies itself (config.final_logit_softcapping="
                         f"{config.final_logit_softcapping}); use lockstep.batch_invariant(), which covers tanh")
    _register_attention()
    modeling = _modeling(family)
    if not getattr(modeling.apply_rotary_pos_emb, "_lockstep", False):
        _saved_apply[family] = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = _make_apply(modeling.apply_rotary_pos_emb)
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, nn.Linear):
            module.forward = (lambda m: lambda x: ops.linear(x, m.weight, m.bias))(module)
        elif name.endswith("RMSNorm"):
            module.forward = _norm_forward(module)
        elif name.endswith("MLP") and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")):
            module.forward = (lambda m: lambda x: m.down_proj(act(m.gate_proj(x), m.up_proj(x))))(module)
        elif name.endswith("TopKRouter"):
            module.forward = _router_forward(module)
        elif name.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = _experts_forward(module, act)
        elif name.endswith("RotaryEmbedding"):
            module.forward = lambda x, position_ids, layer_type=None: (
                _Positions(position_ids, *_rope_params(config, layer_type)), None)
    model._lockstep_attn_before = config._attn_implementation
    config._attn_implementation = _ATTN
    decoder = getattr(model, "model", model)
    model._lockstep_positions_hook = decoder.register_forward_pre_hook(_positions_hook(positions_from_mask),
                                                                      with_kwargs=True)
    model._lockstep_patched = True
    _patched_count += 1
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo `patch`: the original forwards and attention implementation come back."""
    global _patched_count
    _family(model)
    if not getattr(model, "_lockstep_patched", False):
        return model
    for module in model.modules():
        if "forward" in module.__dict__:
            del module.forward
    model.config._attn_implementation = model._lockstep_attn_before
    model._lockstep_positions_hook.remove()
    del model._lockstep_patched, model._lockstep_positions_hook
    _patched_count -= 1
    if _patched_count == 0:
        for fam, original in list(_saved_apply.items()):
            _modeling(fam).apply_rotary_pos_emb = original
            del _saved_apply[fam]
    return model
