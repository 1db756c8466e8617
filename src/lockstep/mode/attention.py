"""The mode's attention: scaled_dot_product_attention on CPU with any causal, boolean or 0/-inf
mask, through the registry's `masked_attention` op (lockstep's fixed 64-key blocks re-anchored at
each query's first visible key). `visible_mask` turns SDPA's arguments into the op's mask;
`OVERRIDES` maps the aten ops to their kernels."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import ops


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


def _default_scale(q: Tensor, scale) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _sdpa_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    if dropout_p > 0:
        return None
    return ops.masked_attention(query, key, value, visible_mask(query, key, attn_mask, is_causal),
                                _default_scale(query, scale))


def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
    """dq, dk, dv by autograd through the same op (its backward recomputes the statistics, so the
    forward saved here is not needed; recomputing it costs one more forward)."""
    visible = visible_mask(query, key, attn_mask, is_causal)
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        o, _ = ops.masked_attention(q, k, v, visible, _default_scale(query, scale))
        return torch.autograd.grad(o, (q, k, v), grad_out)


OVERRIDES = {
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward,
}
