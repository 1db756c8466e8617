"""Causal GQA attention over packed sequences, and the paged KV cache it reads in decode.

One kernel serves full prefill, chunked prefill and decode: a sequence's len_q queries are the last
len_q of its len_k key positions (bottom-right causal mask), and every query reduces over its keys
in fixed blocks anchored at key 0 (docs/adr/0002-attention-reduction-order.md), so its output does
not depend on how its sequence was split or what shared the call.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import autocast
from .. import checks as c
from ..paged_cache import CacheStep
from ..registry import fused_form, resolve
from ..rotary import Rotation
from .rope import checked as checked_rotation
from .rope import rope as _rope

MAX_HEAD_DIM = 256


def _check_cu_seqlens(name: str, cu: Tensor, total: int, rows_name: str) -> list[int]:
    c.int_tensor(name, cu)
    c.ndim(name, cu, 1, "a 1-D tensor [num_seqs + 1]")
    if cu.numel() < 1:
        raise ValueError(f"{name}: expected at least one entry (0), got an empty tensor")
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {values}")
    if values[-1] > total:
        raise ValueError(f"{name}: last offset {values[-1]} exceeds the {total} rows of {rows_name}")
    return values


def _check_qkv_heads(q: Tensor, k: Tensor, v: Tensor, k_name: str, v_name: str) -> None:
    c.float_tensor("q", q)
    c.ndim("q", q, 3, "a 3-D tensor [tokens, q_heads, head_dim]")
    c.float_tensor(k_name, k)
    c.float_tensor(v_name, v)
    for name, t in ((k_name, k), (v_name, v)):
        c.same_dtype(name, t, "q", q)
        c.same_device(name, t, "q", q)
    if k.shape != v.shape:
        raise ValueError(f"{v_name}: expected shape {tuple(k.shape)} (the shape of {k_name}), got {tuple(v.shape)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"{k_name}: expected head_dim {d} (q's head_dim), got {k.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected head_dim in [1, {MAX_HEAD_DIM}], got {d}")
    hq, hkv = q.shape[1], k.shape[-2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{k_name}: expected a number of kv heads that divides q's {hq} heads, got {hkv}")


def _check_options(scale: float | None, window: int | None, causal: bool, head_dim: int) -> float:
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected a positive int or None, got {window!r}")
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")
    return float(scale)


def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
              scale: float | None = None, causal: bool = True, window: int | None = None) -> Tensor:
    """Attention over packed variable-length sequences.

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] with Hq a multiple of Hkv (GQA, MQA); D <= 256; one float dtype.
    cu_seqlens_q, cu_seqlens_k: [B + 1] int offsets of each sequence's queries and keys. Sequence b's
    len_q queries are the last len_q of its len_k key positions (len_q <= len_k), so prefill
    (len_q = len_k), chunked prefill and decode (len_q = 1) are the same call. window: a query at
    position p sees keys j with p - window < j <= p. Rows past cu_seqlens_q[-1] are padding: their
    output is zero. Returns [Tq, Hq, D] in q's dtype; fp32 inside; differentiable in q, k, v.
    """
    q, k, v = autocast.cast("attention", q, k, v)
    _check_qkv_heads(q, k, v, "k", "v")
    c.ndim("k", k, 3, "a 3-D tensor [tokens, kv_heads, head_dim]")
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q")
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k")
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_k: expected {len(cq)} entries like cu_seqlens_q, got {len(ck)}")
    for b, (q0, q1, k0, k1) in enumerate(zip(cq, cq[1:], ck, ck[1:])):
        if q1 - q0 > k1 - k0:
            raise ValueError(f"cu_seqlens_q: sequence {b} has {q1 - q0} queries but only {k1 - k0} keys "
                             "(expected len_q <= len_k)")
    scale = _check_options(scale, window, causal, q.shape[-1])
    with autocast.off(q.device.type):
        return resolve("attention", q.device)(q, k, v, cq, ck, scale, causal, window)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                    cu_seqlens_q: Tensor, scale: float | None = None, causal: bool = True,
                    window: int | None = None) -> Tensor:
    """Attention whose keys and values are read from a paged KV cache (forward only).

    q: [Tq, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_table: [B, max_blocks]
    int, the cache blocks of each sequence in order; seq_lens: [B] int, each sequence's key count
    (cached prefix plus the new tokens, which `write_kv` must already have written);
    cu_seqlens_q: [B + 1]. Bitwise equal to `attention` over the same keys gathered contiguously.
    """
    q, k_cache, v_cache = autocast.cast("paged_attention", q, k_cache, v_cache)
    _check_qkv_heads(q, k_cache, v_cache, "k_cache", "v_cache")
    c.ndim("k_cache", k_cache, 4, "a 4-D cache [num_blocks, block_size, kv_heads, head_dim]")
    c.int_tensor("block_table", block_table)
    c.ndim("block_table", block_table, 2, "a 2-D tensor [num_seqs, max_blocks_per_seq]")
    c.int_tensor("seq_lens", seq_lens)
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q")
    nseq = len(cq) - 1
    if tuple(seq_lens.shape) != (nseq,):
        raise ValueError(f"seq_lens: expected shape [{nseq}] (one per sequence of cu_seqlens_q), got {tuple(seq_lens.shape)}")
    if block_table.shape[0] != nseq:
        raise ValueError(f"block_table: expected {nseq} rows (one per sequence), got {block_table.shape[0]}")
    lens = seq_lens.tolist()
    block_size = k_cache.shape[1]
    for b, n in enumerate(lens):
        if n < cq[b + 1] - cq[b]:
            raise ValueError(f"seq_lens: sequence {b} has {cq[b + 1] - cq[b]} queries but seq_lens {n} "
                             "(expected len_q <= len_k)")
    need = (seq_lens.to(device=block_table.device, dtype=torch.int64) + block_size - 1) // block_size   # [B]
    if nseq and int(need.max()) > block_table.shape[1]:
        b = int(torch.argmax(need))
        raise ValueError(f"block_table: sequence {b} needs {int(need[b])} blocks for {lens[b]} keys, the table has "
                         f"{block_table.shape[1]} columns")
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < need[:, None]
    bad = used & ((block_table < 0) | (block_table >= k_cache.shape[0]))
    if bool(bad.any()):
        b, j = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(f"block_table: sequence {b} points at block {int(block_table[b, j])}, outside "
                         f"the cache's {k_cache.shape[0]} blocks")
    scale = _check_options(scale, window, causal, q.shape[-1])
    with autocast.off(q.device.type):
        return resolve("paged_attention", q.device)(q, k_cache, v_cache, block_table, lens, cq, scale, causal, window)


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write new keys and values into the paged cache, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int,
    slot = block * block_size + offset for each token, all distinct. A plain copy: exact bits. Under
    torch.autocast, keys and values computed in the autocast dtype are stored in the cache's (wider)
    dtype, which holds them exactly.
    """
    k, v = _check_kv(k, v, k_cache, v_cache)
    c.int_tensor("slot_mapping", slot_mapping)
    if tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(f"slot_mapping: expected shape [{k.shape[0]}] (one slot per token), got {tuple(slot_mapping.shape)}")
    c.in_range("slot_mapping", slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    if slot_mapping.numel() != torch.unique(slot_mapping).numel():
        raise ValueError("slot_mapping: expected distinct slots, found a slot written twice")
    _write(k, v, k_cache, v_cache, slot_mapping.long())


def _check_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
    """write_kv's checks of everything but the slots' values (no read of the device); returns k and
    v as the cache stores them."""
    if autocast.enabled(k_cache.device.type) and isinstance(k, Tensor) and isinstance(v, Tensor):
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    c.float_tensor("k", k)
    c.ndim("k", k, 3, "a 3-D tensor [tokens, kv_heads, head_dim]")
    c.float_tensor("k_cache", k_cache)
    c.ndim("k_cache", k_cache, 4, "a 4-D cache [num_blocks, block_size, kv_heads, head_dim]")
    for name, t, ref_name, ref in (("v", v, "k", k), ("v_cache", v_cache, "k_cache", k_cache),
                                   ("k", k, "k_cache", k_cache)):
        c.same_dtype(name, t, ref_name, ref)
        c.same_device(name, t, ref_name, ref)
        if name != "k" and t.shape != ref.shape:
            raise ValueError(f"{name}: expected shape {tuple(ref.shape)} (the shape of {ref_name}), got {tuple(t.shape)}")
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k: expected [T, {k_cache.shape[2]}, {k_cache.shape[3]}] to match the cache, got {tuple(k.shape)}")
    return k, v


def _write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    slots = k_cache.shape[0] * k_cache.shape[1]
    with torch.no_grad():
        k_cache.view(slots, *k_cache.shape[2:])[slot_mapping] = k
        v_cache.view(slots, *v_cache.shape[2:])[slot_mapping] = v


def cached_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, step: CacheStep,
                     scale: float | None = None, window: int | None = None, rope: Rotation | None = None) -> Tensor:
    """One layer's causal attention of a step's new tokens through the paged cache: `write_kv` of
    k, v at the step's slots, then `paged_attention` over each sequence's keys (forward only).

    q: [T, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; step: a
    paged_cache.CacheStep. rope: q and k as given are first rotated as `ops.rope` rotates them by
    rope's positions, theta, style and scaling, with its bits; a backend whose rope carries an
    `into_cache` form (the native and Triton ones) rotates and writes the cache in one call. When
    `build_step` made the step, its checked host copy (step.host) stands for the step's values and
    nothing is read back from the device; otherwise (or when the step's block table or slot
    mapping is not the one build_step made) write_kv and paged_attention
    check them. Returns [T, Hq, D] in q's dtype."""
    if rope is not None and not isinstance(rope, Rotation):
        raise TypeError(f"rope: expected a lockstep.rotary.Rotation or None, got {type(rope).__name__}")
    host = step.host
    if host is None or step.block_table is not host.block_table or step.slot_mapping is not host.slot_mapping:
        if rope is not None:
            q, k = _rotated(q, k, rope)
        write_kv(k, v, k_cache, v_cache, step.slot_mapping)
        return paged_attention(q, k_cache, v_cache, step.block_table, step.seq_lens, step.cu_seqlens_q,
                               scale=scale, window=window)
    well_formed = _cached_well_formed(q, k, v, k_cache, v_cache, step, scale, window)
    into = None
    if rope is not None:
        if well_formed:
            into = fused_form("rope", "into_cache", q.device)
        if into is None:    # rotated here, before any cast to the cache's dtype, as a caller would
            q, k = _rotated(q, k, rope)
    if not well_formed:
        k, v = _check_kv(k, v, k_cache, v_cache)
        for name, t in (("step.slot_mapping", step.slot_mapping), ("step.block_table", step.block_table)):
            c.same_device(name, t, "k_cache", k_cache)
    if host.block_size != k_cache.shape[1] or host.blocks_needed > k_cache.shape[0]:
        raise ValueError(f"step: built for blocks of {host.block_size} up to block {host.blocks_needed - 1}, "
                         f"the cache has {k_cache.shape[0]} blocks of {k_cache.shape[1]}")
    if not q.shape[0] == k.shape[0] == host.cu_seqlens_q[-1]:
        raise ValueError(f"q: expected the step's {host.cu_seqlens_q[-1]} new tokens in q, k and v, got "
                         f"{q.shape[0]}, {k.shape[0]}")
    written = False
    if into is not None:
        positions = checked_rotation(q, rope.positions, rope.theta, rope.style, rope.scaling)
        rotated = into(q, k, v, k_cache, v_cache, step.slot_mapping, positions, float(rope.theta), rope.style,
                       rope.scaling)
        if rotated is not None:
            q, written = rotated, True
        else:
            q, k = _rotated(q, k, rope, positions)
    if not written:
        _write(k, v, k_cache, v_cache, step.slot_mapping)
    if well_formed:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    else:
        # Then read as paged_attention reads: under autocast, q and the cache in autocast's dtype.
        q, k_cache, v_cache = autocast.cast("paged_attention", q, k_cache, v_cache)
        _check_qkv_heads(q, k_cache, v_cache, "k_cache", "v_cache")
        scale = _check_options(scale, window, True, q.shape[-1])
    with autocast.off(q.device.type):
        return resolve("paged_attention", q.device)(q, k_cache, v_cache, step.block_table, host.seq_lens,
                                                    host.cu_seqlens_q, scale, True, window,
                                                    on_device=host.indices32)


def _rotated(q: Tensor, k: Tensor, rope: Rotation, positions=None) -> tuple[Tensor, Tensor]:
    """q and k each rotated by `ops.rope` (positions: rope's, already checked, if given)."""
    at = rope.positions if positions is None else positions
    return _rope(q, at, rope.theta, rope.style, rope.scaling), _rope(k, at, rope.theta, rope.style, rope.scaling)


def _cached_well_formed(q: object, k: object, v: object, k_cache: object, v_cache: object, step: CacheStep,
                        scale: object, window: object) -> bool:
    """Whether cached_attention's checks of its tensors and options would all pass, and autocast is
    off, in one expression: a model's every layer pays for no more; any other call is checked piece
    by piece, naming what is wrong."""
    if not all(isinstance(t, Tensor) for t in (q, k, v, k_cache, v_cache)):
        return False
    dtype, device = q.dtype, q.device
    return (dtype in c.FLOAT_DTYPES and not autocast.enabled(device.type)
            and k.dtype == dtype and v.dtype == dtype and k_cache.dtype == dtype and v_cache.dtype == dtype
            and k.device == device and v.device == device and k_cache.device == device and v_cache.device == device
            and step.slot_mapping.device == device and step.block_table.device == device
            and q.dim() == 3 and k.dim() == 3 and k_cache.dim() == 4 and v.shape == k.shape
            and v_cache.shape == k_cache.shape and k.shape[1:] == k_cache.shape[2:]
            and 1 <= q.shape[2] <= MAX_HEAD_DIM and k.shape[2] == q.shape[2] and k.shape[1] >= 1
            and q.shape[1] % k.shape[1] == 0
            and (window is None or (type(window) is int and window >= 1))
            and (scale is None or (type(scale) is float and 0.0 < scale < math.inf)))
