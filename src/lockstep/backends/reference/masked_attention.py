"""Float64 reference masked attention: the textbook formula; shares no code with the kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register

f64 = torch.float64


def masked_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float | None = None
                     ) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T * scale over the visible keys) V in float64, GQA by repeating the kv heads;
    zeros (and a logsumexp of -inf) for a query that sees no key."""
    q, k, v = q.to(f64), k.to(f64), v.to(f64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    ks, vs = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ ks.transpose(-1, -2) * scale).masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = visible.any(-1)[:, None, :, None]
    weights = torch.where(seen, torch.exp(scores - torch.where(seen[..., 0], lse, 0.0)[..., None]), 0.0)
    return weights @ vs, lse


@register("reference", "masked_attention")
def _registered_masked_attention(q, k, v, visible, scale):
    return masked_attention(q, k, v, visible, scale)
