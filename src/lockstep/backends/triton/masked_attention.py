"""Triton masked attention: attention under an arbitrary boolean mask [B, Lq, Lk], each query's keys
reduced in fixed 64-key blocks anchored at the first key it can see (docs/adr/0015), on the
attention kernels' pieces (`online_softmax_step`, `probs_and_dp`, `tile`).

The queries of a batch entry are grouped by their anchor, and each group is cut into query blocks of
BLOCK_Q rows, from the group's first row (`query_blocks`). A block's rows share its anchor, so they
share its key blocks, and the blocks depend on the mask alone, relative to the entry's first visible
key: padding, other entries and a query decoded alone change no block a row sits in
(docs/adr/0039).

Forward: program (query block, head) walks its key blocks from the anchor, in order. Backward: dq
like the forward; dk and dv one program per (64-key block from the entry's first anchor, kv head),
adding the group's query heads and then the entry's query blocks in order. No atomics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...numerics.fixed_order import KEY_BLOCK
from ...numerics.second_order import first_order_only
from ...registry import register, registered
from .attention import bwd_block_q, fwd_config, online_softmax_step, probs_and_dp, tile
from .common import cast_out, dot, dot_mixed, dot_precision

INT_ARGS = ["Hq", "Hkv", "D", "Lq", "Lk", "stride_qb", "stride_qh", "stride_kb", "stride_kh"]


class QueryBlocks(NamedTuple):
    """Query blocks of BLOCK_Q rows, sorted by (batch entry, anchor, first row), int32 on the mask's
    device. Block i holds rows order[start[i] : start[i] + count[i]] (query indices) of entry
    batch[i]; its rows see keys in [lo[i], hi[i]), lo their shared anchor. Entry b's blocks are
    first[b] to first[b + 1] - 1, its keys [entry_lo[b], entry_hi[b])."""
    order: Tensor
    batch: Tensor
    start: Tensor
    count: Tensor
    lo: Tensor
    hi: Tensor
    first: Tensor
    entry_lo: Tensor
    entry_hi: Tensor


def query_blocks(visible: Tensor, block_q: int) -> QueryBlocks:
    """The query blocks of `visible` [B, Lq, Lk] (bool) at `block_q` rows. Rows that see no key are
    in no block."""
    b, lq, lk = visible.shape
    dev = visible.device
    if lk == 0:                                                 # no key: every row sees nothing
        visible = torch.zeros((b, lq, 1), dtype=torch.bool, device=dev)
        lk = 1
    as_int = visible.to(torch.int32)
    seen = visible.any(-1).reshape(-1)
    anchor = as_int.argmax(-1).reshape(-1)                      # argmax gives the first of the ties
    end = (lk - as_int.flip(-1).argmax(-1)).reshape(-1)
    flat = torch.nonzero(seen)[:, 0]
    # Rows in (entry, anchor, row) order; a stable sort keeps the rows of a group in order.
    key = (flat // lq) * lk + anchor[flat]
    key, perm = torch.sort(key, stable=True)
    flat = flat[perm]
    groups, counts = torch.unique_consecutive(key, return_counts=True)
    per_group = (counts + block_q - 1) // block_q
    total = int(per_group.sum())
    group_of_block = torch.repeat_interleave(torch.arange(groups.numel(), device=dev), per_group)
    blocks_before = torch.cumsum(per_group, 0) - per_group
    rows_before = torch.cumsum(counts, 0) - counts
    nth = torch.arange(total, device=dev) - blocks_before[group_of_block]
    start = rows_before[group_of_block] + nth * block_q
    count = torch.minimum(counts[group_of_block] - nth * block_q, torch.tensor(block_q, device=dev))
    group_of_row = torch.repeat_interleave(torch.arange(groups.numel(), device=dev), counts)
    block_of_row = blocks_before[group_of_row] + (torch.arange(flat.numel(), device=dev)
                                                  - rows_before[group_of_row]) // block_q
    hi = torch.zeros(total, dtype=torch.int64, device=dev).scatter_reduce(0, block_of_row, end[flat], "amax")
    batch = groups[group_of_block] // lk
    lo = groups[group_of_block] % lk
    first = torch.searchsorted(batch, torch.arange(b + 1, device=dev))
    entry_lo = torch.full((b,), lk, dtype=torch.int64, device=dev).scatter_reduce(0, batch, lo, "amin")
    entry_hi = torch.zeros(b, dtype=torch.int64, device=dev).scatter_reduce(0, batch, hi, "amax")
    i32 = [t.to(torch.int32).contiguous() for t in (flat % lq, batch, start, count, lo, hi, first, entry_lo, entry_hi)]
    return QueryBlocks(*i32)


@triton.jit
def _block(i, order_ptr, batch_ptr, start_ptr, count_ptr, lo_ptr, hi_ptr, BLOCK_Q: tl.constexpr):
    """Query block i: its entry b, its rows (query indices) and which are real, and its keys [lo, hi)."""
    b = tl.load(batch_ptr + i).to(tl.int64)
    slots = tl.arange(0, BLOCK_Q)
    row_ok = slots < tl.load(count_ptr + i)
    rows = tl.load(order_ptr + tl.load(start_ptr + i) + slots, mask=row_ok, other=0)
    return b, rows, row_ok, tl.load(lo_ptr + i), tl.load(hi_ptr + i)


@triton.jit
def _keys(k_ptr, v_ptr, vis_ptr, kcol, vrow, row_ok, k0, hi, D, d_ok, BLOCK_K: tl.constexpr):
    """The key block at k0: k, v [BLOCK_K, BLOCK_D] (zeros from hi on) and which of its keys each row
    may see. k_ptr, v_ptr and vis_ptr point at the batch entry; kcol [BLOCK_D] is the kv head's
    offset of each feature, vrow [BLOCK_Q] that of each row's mask: the parts that do not change from
    one key block to the next. Offsets inside an entry are 32-bit (the wrapper checks its size)."""
    keys = k0 + tl.arange(0, BLOCK_K)
    key_ok = keys < hi
    kmask = key_ok[:, None] & d_ok[None, :]
    offs = keys[:, None] * D + kcol[None, :]
    k = tl.load(k_ptr + offs, mask=kmask, other=0.0)
    v = tl.load(v_ptr + offs, mask=kmask, other=0.0)
    vis = tl.load(vis_ptr + vrow[:, None] + keys[None, :], mask=row_ok[:, None] & key_ok[None, :], other=0) != 0
    return k, v, vis


@triton.jit(do_not_specialize=INT_ARGS + ["scale"])
def attn_masked_fwd_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, o_ptr, m_ptr, l_ptr, order_ptr, batch_ptr, start_ptr,
                           count_ptr, lo_ptr, hi_ptr, Hq, Hkv, D, Lq, Lk, scale, stride_qb, stride_qh, stride_kb,
                           stride_kh, PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """Program (i, h): query block i, head h, over its key blocks from its anchor in order."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    b, rows, row_ok, lo, hi = _block(i, order_ptr, batch_ptr, start_ptr, count_ptr, lo_ptr, hi_ptr, BLOCK_Q)
    hk = h // (Hq // Hkv)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    qmask = row_ok[:, None] & d_ok[None, :]
    offs = tile(0, 0, rows, h, D, stride_qh, d)
    q = tl.load(q_ptr + b * stride_qb + offs, mask=qmask, other=0.0)
    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    kcol = hk * stride_kh + d
    vrow = rows * Lk
    for k0 in range(lo, hi, BLOCK_K):
        k, v, vis = _keys(k_ptr + b * stride_kb, v_ptr + b * stride_kb, vis_ptr + b * Lq * Lk, kcol, vrow, row_ok, k0,
                          hi, D, d_ok, BLOCK_K)
        s = tl.where(vis, dot(q, tl.trans(k), PRECISION) * scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * stride_qb + offs, cast_out(out, o_ptr), mask=qmask)
    stat = h * Lq + rows
    tl.store(m_ptr + b * Hq * Lq + stat, m_i, mask=row_ok)
    tl.store(l_ptr + b * Hq * Lq + stat, l_i, mask=row_ok)


@triton.jit
def _block_grad_inputs(q_ptr, do_ptr, m_ptr, l_ptr, b, rows, row_ok, h, Hq, D, Lq, stride_qb, stride_qh, d, d_ok):
    """A query block's q and dO tiles of head h and their offsets in the entry, its softmax shift (0
    for a row that sees no key) and its sum (1 there), and where its statistics lie in the entry's."""
    qmask = row_ok[:, None] & d_ok[None, :]
    offs = tile(0, 0, rows, h, D, stride_qh, d)
    q = tl.load(q_ptr + b * stride_qb + offs, mask=qmask, other=0.0)
    do = tl.load(do_ptr + b * stride_qb + offs, mask=qmask, other=0.0)
    stat = h * Lq + rows
    m_i = tl.load(m_ptr + b * Hq * Lq + stat, mask=row_ok, other=0.0)
    l_i = tl.load(l_ptr + b * Hq * Lq + stat, mask=row_ok, other=1.0)
    return q, do, offs, tl.where(m_i == float("-inf"), 0.0, m_i), tl.where(l_i == 0, 1.0, l_i), stat


@triton.jit(do_not_specialize=INT_ARGS + ["scale"])
def attn_masked_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, do_ptr, m_ptr, l_ptr, dq_ptr, delta_ptr, order_ptr,
                              batch_ptr, start_ptr, count_ptr, lo_ptr, hi_ptr, Hq, Hkv, D, Lq, Lk, scale, stride_qb,
                              stride_qh, stride_kb, stride_kh, PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (i, h): delta = sum_j p_j dp_j and dq of query block i, head h, over its key blocks
    in order (twice)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    b, rows, row_ok, lo, hi = _block(i, order_ptr, batch_ptr, start_ptr, count_ptr, lo_ptr, hi_ptr, BLOCK_Q)
    hk = h // (Hq // Hkv)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q, do, offs, shift, l_safe, stat = _block_grad_inputs(q_ptr, do_ptr, m_ptr, l_ptr, b, rows, row_ok, h, Hq, D,
                                                          Lq, stride_qb, stride_qh, d, d_ok)
    kcol = hk * stride_kh + d
    vrow = rows * Lk
    delta = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k, v, vis = _keys(k_ptr + b * stride_kb, v_ptr + b * stride_kb, vis_ptr + b * Lq * Lk, kcol, vrow, row_ok, k0,
                          hi, D, d_ok, BLOCK_K)
        p, dp = probs_and_dp(q, do, k, v, vis, shift, l_safe, scale, PRECISION)
        delta += tl.sum(p * dp, axis=1)
    dq = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k, v, vis = _keys(k_ptr + b * stride_kb, v_ptr + b * stride_kb, vis_ptr + b * Lq * Lk, kcol, vrow, row_ok, k0,
                          hi, D, d_ok, BLOCK_K)
        p, dp = probs_and_dp(q, do, k, v, vis, shift, l_safe, scale, PRECISION)
        dq += dot_mixed(p * (dp - delta[:, None]), k, PRECISION) * scale
    tl.store(dq_ptr + b * stride_qb + offs, cast_out(dq, dq_ptr), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(delta_ptr + b * Hq * Lq + stat, delta, mask=row_ok)


@triton.jit(do_not_specialize=INT_ARGS + ["scale"])
def attn_masked_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, dk_ptr, dv_ptr,
                                kblk_b_ptr, kblk_k0_ptr, order_ptr, batch_ptr, start_ptr, count_ptr, lo_ptr, hi_ptr,
                                first_ptr, entry_hi_ptr, Hq, Hkv, D, Lq, Lk, scale, stride_qb, stride_qh, stride_kb,
                                stride_kh, PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_D: tl.constexpr):
    """Program (j, hk): dk and dv of key block j (64 keys of one entry, from its first anchor) of kv
    head hk. The group's query heads, then the entry's query blocks that reach the key block, are
    added in order."""
    j = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.load(kblk_b_ptr + j).to(tl.int64)
    k0 = tl.load(kblk_k0_ptr + j)
    group = Hq // Hkv
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    keys = k0 + tl.arange(0, BLOCK_K)
    key_ok = keys < tl.load(entry_hi_ptr + b)
    kmask = key_ok[:, None] & d_ok[None, :]
    koffs = tile(0, 0, keys, hk, D, stride_kh, d)
    k = tl.load(k_ptr + b * stride_kb + koffs, mask=kmask, other=0.0)
    v = tl.load(v_ptr + b * stride_kb + koffs, mask=kmask, other=0.0)
    dk = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)
    first = tl.load(first_ptr + b)
    last = tl.load(first_ptr + b + 1)
    for g in range(0, group):
        h = hk * group + g
        for i in range(first, last):
            # Names bound in the loop are not rebound inside the `if`: Triton would have to merge their types.
            blk_b, rows, row_ok, lo, hi = _block(i, order_ptr, batch_ptr, start_ptr, count_ptr, lo_ptr, hi_ptr,
                                                 BLOCK_Q)
            if (lo < k0 + BLOCK_K) & (hi > k0):
                q, do, q_offs, shift, l_safe, stat = _block_grad_inputs(q_ptr, do_ptr, m_ptr, l_ptr, b, rows, row_ok,
                                                                        h, Hq, D, Lq, stride_qb, stride_qh, d, d_ok)
                delta = tl.load(delta_ptr + b * Hq * Lq + stat, mask=row_ok, other=0.0)
                vis = tl.load(vis_ptr + b * Lq * Lk + rows[:, None] * Lk + keys[None, :],
                              mask=row_ok[:, None] & key_ok[None, :], other=0) != 0
                p, dp = probs_and_dp(q, do, k, v, vis, shift, l_safe, scale, PRECISION)
                dv += dot_mixed(tl.trans(p), do, PRECISION)
                dk += dot_mixed(tl.trans(p * (dp - delta[:, None])), q, PRECISION) * scale
    tl.store(dk_ptr + b * stride_kb + koffs, cast_out(dk, dk_ptr), mask=kmask)
    tl.store(dv_ptr + b * stride_kb + koffs, cast_out(dv, dv_ptr), mask=kmask)


def _tables(blocks: QueryBlocks) -> tuple[Tensor, ...]:
    return blocks.order, blocks.batch, blocks.start, blocks.count, blocks.lo, blocks.hi


def _sizes(q: Tensor, k: Tensor) -> tuple[int, ...]:
    """Hq, Hkv, D, Lq, Lk."""
    return q.shape[1], k.shape[1], q.shape[3], q.shape[2], k.shape[2]


def _forward(q: Tensor, k: Tensor, v: Tensor, vis: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    config = fwd_config(q.dtype)
    blocks = query_blocks(vis, config.block_q)
    o = torch.zeros_like(q)
    m = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    if blocks.batch.numel():
        attn_masked_fwd_kernel[(blocks.batch.numel(), q.shape[1])](
            q, k, v, vis.view(torch.uint8), o, m, l, *_tables(blocks), *_sizes(q, k), scale, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), PRECISION=dot_precision(q.dtype), BLOCK_Q=config.block_q, BLOCK_K=KEY_BLOCK,
            BLOCK_D=triton.next_power_of_2(q.shape[-1]), num_warps=config.num_warps, num_stages=config.num_stages)
    return o, m, l


def _key_blocks(blocks: QueryBlocks) -> tuple[Tensor, Tensor]:
    """Each entry's 64-key blocks from its first anchor to its last visible key: (entry, first key)."""
    lo, hi = blocks.entry_lo.long(), blocks.entry_hi.long()
    per_entry = torch.where(hi > lo, (hi - lo + KEY_BLOCK - 1) // KEY_BLOCK, 0)
    entry = torch.repeat_interleave(torch.arange(lo.numel(), device=lo.device), per_entry)
    nth = torch.arange(entry.numel(), device=lo.device) - (torch.cumsum(per_entry, 0) - per_entry)[entry]
    return entry.to(torch.int32), (lo[entry] + nth * KEY_BLOCK).to(torch.int32)


def _backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, vis: Tensor, m: Tensor, l: Tensor, scale: float
              ) -> tuple[Tensor, Tensor, Tensor]:
    block_q = bwd_block_q(q.dtype)
    blocks = query_blocks(vis, block_q)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = torch.zeros_like(m)
    if not blocks.batch.numel():
        return dq, dk, dv
    vis8 = vis.view(torch.uint8)
    common = dict(PRECISION=dot_precision(q.dtype), BLOCK_Q=block_q, BLOCK_K=KEY_BLOCK,
                  BLOCK_D=triton.next_power_of_2(q.shape[-1]))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    attn_masked_bwd_dq_kernel[(blocks.batch.numel(), q.shape[1])](
        q, k, v, vis8, do, m, l, dq, delta, *_tables(blocks), *_sizes(q, k), scale, *strides, **common)
    kblk_b, kblk_k0 = _key_blocks(blocks)
    if kblk_b.numel():
        attn_masked_bwd_dkdv_kernel[(kblk_b.numel(), k.shape[1])](
            q, k, v, vis8, do, m, l, delta, dk, dv, kblk_b, kblk_k0, *_tables(blocks), blocks.first, blocks.entry_hi,
            *_sizes(q, k), scale, *strides, **common)
    return dq, dk, dv


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, vis, scale):
        # Made contiguous here, not before apply: a caller below autograd's dispatch key (the mode's
        # backward kernels) would not record the copies, and the graph would not reach q, k, v.
        q, k, v, vis = (t.contiguous() for t in (q, k, v, vis))
        o, m, l = _forward(q, k, v, vis, scale)
        ctx.save_for_backward(q, k, v, vis, m, l)
        ctx.scale = scale
        lse = torch.where(l > 0, m + torch.log(l), float("-inf"))
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @first_order_only("masked_attention")
    def backward(ctx, grad, _grad_lse):
        q, k, v, vis, m, l = ctx.saved_tensors
        return (*_backward(grad.contiguous(), q, k, v, vis, m, l, ctx.scale), None, None)


@register("triton", "masked_attention")
def masked_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The Triton masked attention: q [B, Hq, Lq, D], k, v [B, Hkv, Lk, D] (fp32, bf16 or fp16),
    visible [B, Lq, Lk] bool -> (out [B, Hq, Lq, D] in q's dtype, logsumexp [B, Hq, Lq] float32).
    float64, which the kernels do not take, runs the portable masked attention."""
    if q.dtype == torch.float64:
        return registered("portable")["masked_attention"](q, k, v, visible, scale)
    for name, t in (("q", q), ("k", k), ("visible", visible)):
        per_entry = t.numel() // max(1, t.shape[0])
        if per_entry >= 2**31:
            raise ValueError(f"{name}: expected fewer than 2**31 elements per batch entry (the kernels' offsets "
                             f"inside an entry are 32-bit), got {per_entry}")
    return _MaskedAttention.apply(q, k, v, visible, scale)
