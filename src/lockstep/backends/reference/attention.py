"""Float64 reference attention: the textbook formula, written for clarity; shares no code with the
kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register

f64 = torch.float64


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
        pos = torch.arange(length - n, length, device=q.device)[:, None]
        key = torch.arange(length, device=q.device)[None, :]
        allowed = torch.ones(n, length, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= key <= pos
        if window is not None:
            allowed &= key > pos - window
        scores = qs @ ks.transpose(1, 2) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[cq[b]:cq[b + 1]] = (weights @ vs).transpose(0, 1)
    return out


@register("reference", "attention")
def _registered_attention(q, k, v, cu_q, cu_k, scale, causal, window):
    return attention(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), scale, causal, window)
