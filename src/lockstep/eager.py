"""The "eager" backend: plain PyTorch, written the way model code usually is. Not invariant.

It exists for comparison: `lockstep check --backend eager` shows where stock PyTorch breaks the
contract, and the relative-accuracy criterion measures lockstep against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import register
from .ops.rope import rope_inv_freq


@register("eager", "linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


@register("eager", "rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight.to(y.dtype) + offset) * y).to(x.dtype)


@register("eager", "rope")
def rope(x: Tensor, positions: Tensor, theta: float, style: str, scaling) -> Tensor:
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = rope_inv_freq(x.shape[-1], theta, scaling).to(device=x.device, dtype=dt)
    angles = positions.to(dt)[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    xf = x.to(dt)
    if style == "neox":
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


@register("eager", "silu_mul")
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


@register("eager", "embedding")
def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return F.embedding(ids, weight)


@register("eager", "log_softmax")
def log_softmax(x: Tensor) -> Tensor:
    return torch.log_softmax(x.float() if x.dtype != torch.float64 else x, dim=-1).to(x.dtype)


@register("eager", "selected_logprobs")
def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> Tensor:
    logits = F.linear(hidden, weight)
    logits = (logits.float() if logits.dtype != torch.float64 else logits) / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    return lp if lp.dtype == torch.float64 else lp.float()


@register("eager", "cross_entropy")
def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


def _bottom_right_mask(len_q: int, len_k: int, causal: bool, window: int | None, device) -> Tensor:
    pos = torch.arange(len_k - len_q, len_k, device=device)[:, None]
    keys = torch.arange(len_k, device=device)[None, :]
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if causal:
        mask &= keys <= pos
    if window is not None:
        mask &= keys > pos - window
    return mask


@register("eager", "attention")
def attention(q, k, v, cu_q, cu_k, scale, causal, window):
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        mask = _bottom_right_mask(qs.shape[0], ks.shape[0], causal, window, q.device)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    pad = q.new_zeros((q.shape[0] - cu_q[-1],) + tuple(q.shape[1:]))
    return torch.cat(outs + [pad])


@register("eager", "paged_attention")
def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window):
    from .portable.attention import gather_packed

    cu_k = [0]
    for n in seq_lens:
        cu_k.append(cu_k[-1] + n)
    k, v = gather_packed(k_cache, block_table, seq_lens), gather_packed(v_cache, block_table, seq_lens)
    return attention(q, k, v, cu_q, cu_k, scale, causal, window)
