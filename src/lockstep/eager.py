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
def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    logits = F.linear(hidden, weight)
    logits = logits.float() if logits.dtype != torch.float64 else logits
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0].float()


@register("eager", "cross_entropy")
def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str) -> Tensor:
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)
