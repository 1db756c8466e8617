"""Eager attention: torch's scaled_dot_product_attention per sequence, with a bottom-right causal
mask. Not invariant; for comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...paged_cache import gather_packed
from ...registry import register


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
def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window, *, on_device=None):
    cu_k = [0]
    for n in seq_lens:
        cu_k.append(cu_k[-1] + n)
    k, v = gather_packed(k_cache, block_table, seq_lens), gather_packed(v_cache, block_table, seq_lens)
    return attention(q, k, v, cu_q, cu_k, scale, causal, window)
