"""Attention under an arbitrary boolean mask: what scaled_dot_product_attention computes for padded
batches (left or right padding, a KV cache longer than the prompt, bidirectional spans), batch
invariant. lockstep.mode's scaled_dot_product_attention and lockstep.patch's attention function
run it; lockstep's own model uses `attention` over packed sequences instead.

Each query reduces over its keys in lockstep's fixed 64-key blocks, anchored at the first key it
can see (docs/adr/0015), so left padding, right padding, a longer cache or a single decode query
change no bit of its output.
"""

from __future__ import annotations

import math

from torch import Tensor

from .. import autocast
from .. import checks as c
from ..registry import resolve
from .attention import MAX_HEAD_DIM


def masked_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float | None = None
                     ) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale, over the visible keys) v, per batch entry and head.

    q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D] with Hq a multiple of Hkv (GQA); D <= 256; one float
    dtype. visible: [B, Lq, Lk] bool, the keys each query may see (one mask for all heads). A query
    that sees no key gets zeros. Returns (out [B, Hq, Lq, D] in q's dtype, differentiable in q, k
    and v; logsumexp [B, Hq, Lq] float32, of the scaled scores over the visible keys, -inf where
    none is visible)."""
    q, k, v = autocast.cast("masked_attention", q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        c.float_tensor(name, t)
        c.ndim(name, t, 4, "a 4-D tensor [batch, heads, length, head_dim]")
    for name, t in (("k", k), ("v", v)):
        c.same_dtype(name, t, "q", q)
        c.same_device(name, t, "q", q)
    if k.shape != v.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (the shape of k), got {tuple(v.shape)}")
    b, hq, lq, d = q.shape
    if k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"k: expected [{b}, kv_heads, length, {d}] (q's batch and head_dim), got {tuple(k.shape)}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected head_dim in [1, {MAX_HEAD_DIM}], got {d}")
    if k.shape[1] < 1 or hq % k.shape[1]:
        raise ValueError(f"k: expected a number of kv heads that divides q's {hq} heads, got {k.shape[1]}")
    c.bool_tensor("visible", visible)
    if tuple(visible.shape) != (b, lq, k.shape[2]):
        raise ValueError(f"visible: expected shape [{b}, {lq}, {k.shape[2]}] (batch, queries, keys), got "
                         f"{tuple(visible.shape)}")
    c.same_device("visible", visible, "q", q)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")
    with autocast.off(q.device.type):
        return resolve("masked_attention", q.device)(q, k, v, visible, float(scale))
