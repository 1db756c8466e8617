"""Eager masked attention: torch's scaled_dot_product_attention with the boolean mask. Not
invariant; for comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...registry import register


@register("eager", "masked_attention")
def masked_attention(q, k, v, visible, scale):
    mask = visible[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    seen = visible.any(-1)[:, None, :, None]
    out = torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))   # stock gives NaN there
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    scores = (q.to(acc) @ k.to(acc).repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1).to(torch.float32)
    return out, lse
