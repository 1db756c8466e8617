"""The mode's attention: scaled_dot_product_attention on CPU with any causal, boolean or 0/-inf
mask, as lockstep's fixed 64-key blocks re-anchored at each query's first visible key (the portable
backend's per-sequence forward and backward). `MaskedAttention` is the differentiable form that
lockstep.patch installs; `OVERRIDES` maps the aten ops to their kernels."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..backends.portable import attention as portable_attention
from ..fixed_order import accumulate_dtype, log


def visible_mask(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """[B, Lq, Lk] bool from SDPA's arguments; the mask must not differ between heads."""
    b, lq, lk = q.shape[0], q.shape[-2], k.shape[-2]
    vis = torch.ones((b, lq, lk), dtype=torch.bool, device=q.device)
    if is_causal:
        vis &= torch.ones((lq, lk), dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        m = attn_mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        if m.shape[1] != 1 and not bool((m == m[:, :1]).all()):
            raise NotImplementedError("lockstep attention: a mask that differs between heads is not supported")
        m = m[:, 0].expand(b, lq, lk)
        if m.dtype == torch.bool:
            vis &= m
        else:
            masked = m <= torch.finfo(m.dtype).min / 2
            if not bool(((m == 0) | masked).all()):
                raise NotImplementedError("lockstep attention: float masks must hold only 0 and -inf (or the "
                                          "dtype's minimum); additive biases are not supported")
            vis &= ~masked
    return vis


def _anchor_groups(visible: Tensor) -> list[tuple[int, Tensor]]:
    """For one batch entry's [Lq, Lk] mask: (anchor key, query rows) for each distinct first visible
    key. Rows that see no key form no group (their output is zero)."""
    seen = visible.any(dim=1)
    first = visible.int().argmax(dim=1)
    groups = []
    for a in torch.unique(first[seen]).tolist():
        groups.append((a, torch.nonzero(seen & (first == a))[:, 0]))
    return groups


def masked_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """q [B, Hq, Lq, D], k, v [B, Hkv, Lk, D], visible [B, Lq, Lk] -> (out [B, Hq, Lq, D], logsumexp [B, Hq, Lq]).

    Each query's keys are re-anchored at the first key it can see, then reduced in lockstep's fixed
    64-key blocks, so left padding, right padding, a longer cache or a single decode query change no
    bit of its output. Queries that share an anchor run together."""
    acc = accumulate_dtype(q.dtype)
    b, hq, lq, _ = q.shape
    hkv = k.shape[1]
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((b, hq, lq), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(b):
        for a, rows in _anchor_groups(visible[i]):
            qi = q[i][:, rows].transpose(0, 1).to(acc)
            ki, vi = k[i, :, a:].transpose(0, 1).to(acc), v[i, :, a:].transpose(0, 1).to(acc)
            o, st = portable_attention.group_forward(qi[None], ki[None], vi[None], [ki.shape[0]], scale, False, None,
                                        visible[i][rows, a:][None])
            out[i][:, rows] = o[0].transpose(0, 1)
            g = (st[0] + log(st[1])).reshape(hkv, len(rows), hq // hkv).permute(0, 2, 1).reshape(hq, len(rows))
            lse[i][:, rows] = g.to(torch.float32)
    return out.to(q.dtype), lse


def masked_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, visible: Tensor,
                              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    acc = accumulate_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    for i in range(q.shape[0]):
        for a, rows in _anchor_groups(visible[i]):
            qi = q[i][:, rows].transpose(0, 1).to(acc)
            ki, vi = k[i, :, a:].transpose(0, 1).to(acc), v[i, :, a:].transpose(0, 1).to(acc)
            m = visible[i][rows, a:]
            _, stats = portable_attention.group_forward(qi[None], ki[None], vi[None], [ki.shape[0]], scale, False, None, m[None])
            gq, gk, gv = portable_attention.sequence_backward(qi, ki, vi, grad_out[i][:, rows].transpose(0, 1).to(acc), stats,
                                                 scale, False, None, m)
            dq[i][:, rows] = gq.transpose(0, 1)
            dk[i, :, a:] += gk.transpose(0, 1)       # anchor groups in increasing order: a fixed order
            dv[i, :, a:] += gv.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class MaskedAttention(torch.autograd.Function):
    """Differentiable `masked_attention` (used by lockstep.patch's attention function)."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale):
        ctx.save_for_backward(q, k, v, visible)
        ctx.scale = scale
        return masked_attention(q, k, v, visible, scale)[0]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, visible = ctx.saved_tensors
        return (*masked_attention_backward(grad, q, k, v, visible, ctx.scale), None, None)


def _default_scale(q: Tensor, scale) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _sdpa_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    if dropout_p > 0:
        return None
    return masked_attention(query, key, value, visible_mask(query, key, attn_mask, is_causal), _default_scale(query, scale))


def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
    return masked_attention_backward(grad_out, query, key, value, visible_mask(query, key, attn_mask, is_causal),
                                     _default_scale(query, scale))


OVERRIDES = {
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward,
}
