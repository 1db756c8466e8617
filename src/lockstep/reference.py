"""Float64 reference implementations of every op, written for clarity.

They share no code with the kernels: each is the textbook formula in float64 PyTorch, and
autograd through it gives the reference gradients. Inputs of any float dtype are promoted to
float64; outputs are float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

f64 = torch.float64


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    y = x.to(f64) @ weight.to(f64).T
    return y if bias is None else y + bias.to(f64)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    x = x.to(f64)
    rms = torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return x / rms * (offset + weight.to(f64))


def rope(x: Tensor, positions: Tensor, theta: float = 10000.0, style: str = "neox", scaling=None) -> Tensor:
    x = x.to(f64)
    d = x.shape[-1]
    freqs = []
    for i in range(d // 2):
        f = theta ** (-2.0 * i / d)
        if scaling is not None:
            old = scaling.original_max_position_embeddings
            wavelength = 2 * math.pi / f
            if wavelength > old / scaling.low_freq_factor:
                f = f / scaling.factor
            elif wavelength >= old / scaling.high_freq_factor:
                s = (old / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
                f = (1 - s) * f / scaling.factor + s * f
        freqs.append(f)
    angle = positions.to(f64)[:, None] * torch.tensor(freqs, dtype=f64, device=x.device)[None, :]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    if style == "neox":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    g = gate.to(f64)
    return g / (1 + torch.exp(-g)) * up.to(f64)


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    return weight.to(f64)[ids]


def log_softmax(x: Tensor) -> Tensor:
    x = x.to(f64)
    m = x.max(dim=-1, keepdim=True).values
    return x - m - torch.log(torch.exp(x - m).sum(dim=-1, keepdim=True))


def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    logp = log_softmax(linear(hidden, weight) / temperature)
    return logp.gather(-1, targets.long()[..., None])[..., 0]


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    logp = log_softmax(logits)
    valid = targets != ignore_index
    nll = -logp.gather(-1, torch.where(valid, targets, 0).long()[..., None])[..., 0]
    nll = torch.where(valid, nll, torch.zeros_like(nll))
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / valid.sum()


def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
              scale: float | None = None, causal: bool = True, window: int | None = None) -> Tensor:
    """softmax(Q K^T * scale + mask) V per sequence, bottom-right causal, in float64."""
    q, k, v = q.to(f64), k.to(f64), v.to(f64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros_like(q)
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1)                                 # [Hq, n, D]
        ks = k[ck[b]:ck[b + 1]].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        vs = v[ck[b]:ck[b + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        n, length = qs.shape[1], ks.shape[1]
        pos = torch.arange(length - n, length)[:, None]
        key = torch.arange(length)[None, :]
        allowed = torch.ones(n, length, dtype=torch.bool)
        if causal:
            allowed &= key <= pos
        if window is not None:
            allowed &= key > pos - window
        scores = qs @ ks.transpose(1, 2) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[cq[b]:cq[b + 1]] = (weights @ vs).transpose(0, 1)
    return out
