"""Triton attention: fixed 64-key blocks anchored at key 0, the same loop for one query (decode) as
for many (prefill), paged-cache reads through the block table, and a deterministic backward.

Forward: one program per (block of BLOCK_Q queries of one sequence, query head). It walks the key
blocks from key 0 in order; a block that a row cannot see is an exact no-op for that row, so a
query's arithmetic does not depend on which other queries share its program.
Backward: `attn_bwd_dq_kernel` (same grid) first accumulates delta = sum_j p_j dp_j over the key
blocks in order, then dq. `attn_bwd_dkdv_kernel` runs one program per (key block, kv head) and adds
the contributions of the group's query heads and of the query blocks in a fixed order. There are
no atomics; probabilities are recomputed.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...numerics.fixed_order import KEY_BLOCK, accumulate_dtype
from ...registry import register
from ...numerics.second_order import first_order_only
from .common import cast_out, dot, dot_mixed, dot_precision, gpu_capability

BLOCK_Q = 16  # the query tile where FWD_CONFIGS and BWD_BLOCK_Q have no entry for the GPU


class AttentionConfig(NamedTuple):
    """The forward's launch: BLOCK_Q queries per program, warps and pipeline stages."""
    block_q: int
    num_warps: int = 4
    num_stages: int = 3


# The forward's launch per GPU architecture, as GEMM_CONFIGS. A row's sum over keys is the same at
# every BLOCK_Q (a key block a row cannot see is an exact no-op), so the tile is free to follow
# speed, but the MMA instruction follows it: on an H200, 64 and 128 query rows gave other bits than
# 16 and 32, each still batch invariant and with decode == prefill (bench_attention_tiles.py,
# docs/gpu.md). (64, 4 warps) speeds prefill and leaves decode as it was; (128, 8 warps) wins
# only at long prefill and loses at a many-sequence decode.
FWD_CONFIGS = {None: AttentionConfig(BLOCK_Q), 90: AttentionConfig(64, 4, 3)}
# The backward's query tile. It does fix an order: dK and dV sum the query rows BLOCK_Q at a time,
# anchored at query 0 whatever the batch. 64 is the fastest that
# compiles on Hopper (docs/gpu.md); 128 did not compile under Triton 3.6.
BWD_BLOCK_Q = {None: BLOCK_Q, 90: 64}
# Both tables were measured in bf16, and fp32 keeps the default tile on every GPU (ADR 0030): its
# tiles, multiplied on FFMA, do not fit in registers at 64 query rows, where ptxas wrote 3.7-63 KB of
# spill stores per binary on sm_90a, against 0-24 KB at 16 rows (`lockstep gpu-audit`).
WIDE_TILE_DTYPES = (torch.bfloat16, torch.float16)


def fwd_config(dtype: torch.dtype) -> AttentionConfig:
    """The forward's launch configuration for `dtype` on the current architecture (FWD_CONFIGS)."""
    arch = gpu_capability() if dtype in WIDE_TILE_DTYPES else None
    return FWD_CONFIGS.get(arch, FWD_CONFIGS[None])


def bwd_block_q(dtype: torch.dtype) -> int:
    """The backward's query tile for `dtype` on the current architecture (BWD_BLOCK_Q)."""
    arch = gpu_capability() if dtype in WIDE_TILE_DTYPES else None
    return BWD_BLOCK_Q.get(arch, BWD_BLOCK_Q[None])


INT_ARGS = ["Hq", "Hkv", "D", "window", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "table_stride",
            "block_size", "n_blocks"]


@triton.jit
def _key_addr(k_base, b, keys, key_ok, ks, table_ptr, table_stride, block_size, stride_kt, PAGED: tl.constexpr):
    if PAGED:
        blk = tl.load(table_ptr + b * table_stride + keys // block_size, mask=key_ok, other=0)
        return k_base + (blk * block_size + keys % block_size) * stride_kt
    return k_base + (ks + keys) * stride_kt


@triton.jit
def tile(base, first, idx, head, stride_t, stride_h, d):
    """Pointers [N, BLOCK_D] to a tile of q, k, v (or their gradients): tokens first + idx [N] of head
    `head`, features d [BLOCK_D]. Each term is added to the pointer in turn: summing the 32-bit
    offsets first could overflow where the pointer sums do not."""
    return base + (first + idx)[:, None] * stride_t + head * stride_h + d[None, :]


@triton.jit
def _sequence(b, cu_q_ptr, cu_k_ptr, lens_ptr, PAGED: tl.constexpr):
    """Sequence b's first query and query count, and its first key (0 in a paged cache, whose keys
    the block table finds) and key count."""
    qs = tl.load(cu_q_ptr + b)
    len_q = tl.load(cu_q_ptr + b + 1) - qs
    if PAGED:
        ks = 0
        len_k = tl.load(lens_ptr + b)
    else:
        ks = tl.load(cu_k_ptr + b)
        len_k = tl.load(cu_k_ptr + b + 1) - ks
    return qs, len_q, ks, len_k


@triton.jit
def _query_block(blk_seq_ptr, blk_q0_ptr, cu_q_ptr, cu_k_ptr, lens_ptr, Hq, Hkv, D, window, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Where program (i, h) of the forward and dq kernels works: queries [q0, q0 + BLOCK_Q) of
    sequence b = blk_seq[i], query head h. Returns b, h, its kv head hk, the sequence's first query
    qs, first key ks and key count len_k, the rows (query indices in the sequence), which are real
    (row_ok), their positions among the keys (pos), the feature lanes d and which are real (d_ok),
    and the key range [lo, hi) that the rows can see, lo a multiple of BLOCK_K."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(blk_seq_ptr + i)
    q0 = tl.load(blk_q0_ptr + i)
    qs, len_q, ks, len_k = _sequence(b, cu_q_ptr, cu_k_ptr, lens_ptr, PAGED)
    hk = h // (Hq // Hkv)
    rows = q0 + tl.arange(0, BLOCK_Q)
    row_ok = rows < len_q
    pos = len_k - len_q + rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    hi = len_k
    if CAUSAL:
        hi = tl.minimum(len_k, len_k - len_q + tl.minimum(q0 + BLOCK_Q, len_q))
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, len_k - len_q + q0 - window + 1) // BLOCK_K * BLOCK_K
    return b, h, hk, qs, ks, len_k, rows, row_ok, pos, d, d_ok, lo, hi


@triton.jit
def _visible(keys, key_ok, pos, row_ok, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    vis = key_ok[None, :] & row_ok[:, None]
    if CAUSAL:
        vis = vis & (keys[None, :] <= pos[:, None])
    if HAS_WINDOW:
        vis = vis & (keys[None, :] > pos[:, None] - window)
    return vis


@triton.jit
def probs_and_dp(q, do, k, v, vis, shift, l_safe, scale, PRECISION: tl.constexpr):
    """Recomputed probabilities p = exp(s - max) / sum of one key block, 0 where `vis` [BLOCK_Q,
    BLOCK_K] is false, and dp = dO V^T (attention's and masked attention's backward)."""
    s = dot(q, tl.trans(k), PRECISION) * scale
    p = tl.where(vis, tl.exp(s - shift[:, None]) / l_safe[:, None], 0.0)
    return p, dot(do, tl.trans(v), PRECISION)


@triton.jit
def _probs_and_dp(q, do, k, v, keys, key_ok, pos, row_ok, shift, l_safe, scale, window, CAUSAL: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    vis = _visible(keys, key_ok, pos, row_ok, window, CAUSAL, HAS_WINDOW)
    return probs_and_dp(q, do, k, v, vis, shift, l_safe, scale, PRECISION)


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One key block of the forward: each row's running max m_i, sum l_i and output acc updated by
    the block's scores s [BLOCK_Q, BLOCK_K] (-inf where the row cannot see the key) and values v.
    A block that a row cannot see leaves its three unchanged (attention's and masked attention's
    forward)."""
    new = tl.maximum(m_i, tl.max(s, axis=1))
    shift = tl.where(new == float("-inf"), 0.0, new)
    alpha = tl.exp(m_i - shift)
    p = tl.exp(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot_mixed(p, v, PRECISION)
    return new, l_i, acc


@triton.jit
def _key_block_probs(q, do, k_ptr, v_ptr, k0, ks, len_k, hk, stride_kt, stride_kh, d, d_ok, pos, row_ok, shift, l_safe,
                     scale, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """The key block at k0 of a query block's backward: its keys, p and dp (both dq passes recompute them)."""
    keys = k0 + tl.arange(0, BLOCK_K)
    key_ok = keys < len_k
    kmask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(tile(k_ptr, ks, keys, hk, stride_kt, stride_kh, d), mask=kmask, other=0.0)
    v = tl.load(tile(v_ptr, ks, keys, hk, stride_kt, stride_kh, d), mask=kmask, other=0.0)
    p, dp = _probs_and_dp(q, do, k, v, keys, key_ok, pos, row_ok, shift, l_safe, scale, window, CAUSAL, HAS_WINDOW,
                          PRECISION)
    return k, p, dp


@triton.jit(do_not_specialize=INT_ARGS + ["scale"])
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, blk_seq_ptr, blk_q0_ptr, cu_q_ptr, cu_k_ptr,
                    lens_ptr, table_ptr, Hq, Hkv, D, scale, window, stride_qt, stride_qh, stride_kt, stride_kh,
                    table_stride, block_size, n_blocks, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    PAGED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Program (i, h): queries [q0, q0 + BLOCK_Q) of sequence b = blk_seq[i], head h, over key blocks
    from key 0 in order."""
    b, h, hk, qs, ks, len_k, rows, row_ok, pos, d, d_ok, lo, hi = _query_block(
        blk_seq_ptr, blk_q0_ptr, cu_q_ptr, cu_k_ptr, lens_ptr, Hq, Hkv, D, window, CAUSAL, HAS_WINDOW, PAGED, BLOCK_Q,
        BLOCK_K, BLOCK_D)
    q = tl.load(tile(q_ptr, qs, rows, h, stride_qt, stride_qh, d), mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        keys = k0 + tl.arange(0, BLOCK_K)
        key_ok = keys < len_k
        addr = _key_addr(k_ptr, b, keys, key_ok, ks, table_ptr, table_stride, block_size, stride_kt, PAGED)
        k = tl.load(addr[:, None] + hk * stride_kh + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        s = dot(q, tl.trans(k), PRECISION) * scale
        s = tl.where(_visible(keys, key_ok, pos, row_ok, window, CAUSAL, HAS_WINDOW), s, float("-inf"))
        vaddr = _key_addr(v_ptr, b, keys, key_ok, ks, table_ptr, table_stride, block_size, stride_kt, PAGED)
        v = tl.load(vaddr[:, None] + hk * stride_kh + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
    tl.store(tile(o_ptr, qs, rows, h, stride_qt, stride_qh, d), cast_out(out, o_ptr),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(m_ptr + (qs + rows) * Hq + h, m_i, mask=row_ok)
    tl.store(l_ptr + (qs + rows) * Hq + h, l_i, mask=row_ok)


@triton.jit(do_not_specialize=INT_ARGS + ["scale"])
def attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, m_ptr, l_ptr, dq_ptr, delta_ptr, blk_seq_ptr, blk_q0_ptr,
                       cu_q_ptr, cu_k_ptr, Hq, Hkv, D, scale, window, stride_qt, stride_qh, stride_kt, stride_kh,
                       n_blocks, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (i, h): delta and dq of one block of queries, over the key blocks in order (twice)."""
    b, h, hk, qs, ks, len_k, rows, row_ok, pos, d, d_ok, lo, hi = _query_block(
        blk_seq_ptr, blk_q0_ptr, cu_q_ptr, cu_k_ptr, cu_k_ptr, Hq, Hkv, D, window, CAUSAL, HAS_WINDOW, False, BLOCK_Q,
        BLOCK_K, BLOCK_D)
    qmask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(tile(q_ptr, qs, rows, h, stride_qt, stride_qh, d), mask=qmask, other=0.0)
    do = tl.load(tile(do_ptr, qs, rows, h, stride_qt, stride_qh, d), mask=qmask, other=0.0)
    m_i = tl.load(m_ptr + (qs + rows) * Hq + h, mask=row_ok, other=0.0)
    l_i = tl.load(l_ptr + (qs + rows) * Hq + h, mask=row_ok, other=1.0)
    shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_safe = tl.where(l_i == 0, 1.0, l_i)
    delta = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k, p, dp = _key_block_probs(q, do, k_ptr, v_ptr, k0, ks, len_k, hk, stride_kt, stride_kh, d, d_ok, pos,
                                    row_ok, shift, l_safe, scale, window, CAUSAL, HAS_WINDOW, PRECISION, BLOCK_K)
        delta += tl.sum(p * dp, axis=1)
    dq = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k, p, dp = _key_block_probs(q, do, k_ptr, v_ptr, k0, ks, len_k, hk, stride_kt, stride_kh, d, d_ok, pos,
                                    row_ok, shift, l_safe, scale, window, CAUSAL, HAS_WINDOW, PRECISION, BLOCK_K)
        ds = p * (dp - delta[:, None])
        dq += dot_mixed(ds, k, PRECISION) * scale
    tl.store(tile(dq_ptr, qs, rows, h, stride_qt, stride_qh, d), cast_out(dq, dq_ptr), mask=qmask)
    tl.store(delta_ptr + (qs + rows) * Hq + h, delta, mask=row_ok)


@triton.jit(do_not_specialize=INT_ARGS + ["scale"])
def attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, dk_ptr, dv_ptr, kblk_seq_ptr,
                         kblk_k0_ptr, cu_q_ptr, cu_k_ptr, Hq, Hkv, D, scale, window, stride_qt, stride_qh, stride_kt,
                         stride_kh, n_blocks, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """Program (j, hk): dk and dv of one key block of one kv head; the group's query heads, then the
    query blocks, are added in order."""
    j = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.load(kblk_seq_ptr + j)
    k0 = tl.load(kblk_k0_ptr + j)
    qs, len_q, ks, len_k = _sequence(b, cu_q_ptr, cu_k_ptr, cu_k_ptr, False)
    group = Hq // Hkv
    keys = k0 + tl.arange(0, BLOCK_K)
    key_ok = keys < len_k
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    kmask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(tile(k_ptr, ks, keys, hk, stride_kt, stride_kh, d), mask=kmask, other=0.0)
    v = tl.load(tile(v_ptr, ks, keys, hk, stride_kt, stride_kh, d), mask=kmask, other=0.0)
    dk = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)
    first_q = 0
    if CAUSAL:
        first_q = tl.maximum(0, k0 - (len_k - len_q)) // BLOCK_Q * BLOCK_Q
    last_q = len_q
    if HAS_WINDOW:
        last_q = tl.minimum(len_q, k0 + BLOCK_K - 1 + window - (len_k - len_q))
    for g in range(0, group):
        h = hk * group + g
        for q0 in range(first_q, last_q, BLOCK_Q):
            rows = q0 + tl.arange(0, BLOCK_Q)
            row_ok = rows < len_q
            pos = len_k - len_q + rows
            qmask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(tile(q_ptr, qs, rows, h, stride_qt, stride_qh, d), mask=qmask, other=0.0)
            do = tl.load(tile(do_ptr, qs, rows, h, stride_qt, stride_qh, d), mask=qmask, other=0.0)
            m_i = tl.load(m_ptr + (qs + rows) * Hq + h, mask=row_ok, other=0.0)
            l_i = tl.load(l_ptr + (qs + rows) * Hq + h, mask=row_ok, other=1.0)
            delta = tl.load(delta_ptr + (qs + rows) * Hq + h, mask=row_ok, other=0.0)
            shift = tl.where(m_i == float("-inf"), 0.0, m_i)
            p, dp = _probs_and_dp(q, do, k, v, keys, key_ok, pos, row_ok, shift, tl.where(l_i == 0, 1.0, l_i),
                                  scale, window, CAUSAL, HAS_WINDOW, PRECISION)
            dv += dot_mixed(tl.trans(p), do, PRECISION)
            ds = p * (dp - delta[:, None])
            dk += dot_mixed(tl.trans(ds), q, PRECISION) * scale
    tl.store(tile(dk_ptr, ks, keys, hk, stride_kt, stride_kh, d), cast_out(dk, dk_ptr), mask=kmask)
    tl.store(tile(dv_ptr, ks, keys, hk, stride_kt, stride_kh, d), cast_out(dv, dv_ptr), mask=kmask)


def _blocks(lengths: list[int], step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    seq, start = [], []
    for b, n in enumerate(lengths):
        for s in range(0, n, step):
            seq.append(b)
            start.append(s)
    return (torch.tensor(seq, dtype=torch.int32, device=device), torch.tensor(start, dtype=torch.int32, device=device))


def _forward(q, k, v, cu_q, cu_k, lens, table, scale, causal, window, paged, config: AttentionConfig | None = None,
             on_device: tuple[torch.Tensor, torch.Tensor] | None = None):
    config = config or fwd_config(q.dtype)
    tq, hq, d = q.shape
    hkv = k.shape[-2]
    acc = accumulate_dtype(q.dtype)
    # The kernel writes every row of cu_q's sequences, every head: only padding rows past them (zeros,
    # by the contract) need a fill.
    o = torch.empty_like(q)
    m = torch.empty((tq, hq), dtype=acc, device=q.device)
    l = torch.empty_like(m)
    if cu_q[-1] < tq:
        for t in (o, m, l):
            t[cu_q[-1]:].zero_()
    # A step's sequences have at least one new token each (build_step), so as many tokens as
    # sequences means one each: a decode step, whose query blocks depend on its size alone.
    if on_device is not None and len(cu_q) - 1 == cu_q[-1] == tq:
        bseq, bq0 = _decode_blocks(tq, q.device)
        cu_q_t, lens_t, table_t = on_device
        cu_k_t = cu_q_t
    else:
        bseq, bq0, cu_q_t, cu_k_t, lens_t, table_t = _launch_metadata(cu_q, cu_k, lens, table, config.block_q,
                                                                      q.device)
    if bseq.numel():
        stride_kt = k.stride(-3) if not paged else k.stride(1)
        attn_fwd_kernel[(bseq.numel(), hq)](
            q, k, v, o, m, l, bseq, bq0, cu_q_t, cu_k_t, lens_t, table_t, hq, hkv, d, scale, window or 0,
            q.stride(0), q.stride(1), stride_kt, k.stride(-2), table_t.stride(0) if table is not None else 0,
            k.shape[1] if paged else 1, bseq.numel(), CAUSAL=causal, HAS_WINDOW=window is not None, PAGED=paged,
            PRECISION=dot_precision(q.dtype), BLOCK_Q=config.block_q, BLOCK_K=KEY_BLOCK,
            BLOCK_D=triton.next_power_of_2(d), num_warps=config.num_warps, num_stages=config.num_stages)
    return o, m, l


# Unbounded, as a captured CUDA graph reads these tensors' memory (one pair per bucket size).
@functools.cache
def _decode_blocks(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The query blocks of `rows` sequences of one new token each: block i is row 0 of sequence i."""
    return (torch.arange(rows, dtype=torch.int32, device=device), torch.zeros(rows, dtype=torch.int32, device=device))


# The last paged step's launch metadata, with what it was made from. Every layer of a forward passes
# the same step (build_step's tuples and block table), so the step's metadata moves to the device
# once, not once per layer; on a GPU each move is a copy and a wait on the host's memory.
_last_step: tuple | None = None
_last_step_lock = threading.Lock()


def _launch_metadata(cu_q, cu_k, lens, table, block_q: int, device) -> tuple[torch.Tensor, ...]:
    """(q blocks' sequence, q blocks' first row, cu_q, cu_k, lens, block table) as the kernels take
    them: int32 on `device`. Reused for the same step: cu_q and lens the same tuples (immutable), and
    the same block table tensor, unchanged since (its version counter)."""
    global _last_step
    key = None
    if paged_step := isinstance(cu_q, tuple) and isinstance(lens, tuple) and table is not None:
        key = (cu_q, lens, table, table._version, block_q, device)
        with _last_step_lock:
            hit = _last_step
        if hit is not None and len(hit[0]) == len(key) and all(a is b for a, b in zip(hit[0][:3], key[:3])) \
                and hit[0][3:] == key[3:]:
            return hit[1]
    lq = [cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)]
    bseq, bq0 = _blocks(lq, block_q, device)
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=device)
    cu_k_t = torch.tensor(cu_k if cu_k is not None else [0], dtype=torch.int32, device=device)
    lens_t = torch.tensor(lens if lens is not None else [0], dtype=torch.int32, device=device)
    table_t = table.to(torch.int32).contiguous() if table is not None else cu_k_t
    made = (bseq, bq0, cu_q_t, cu_k_t, lens_t, table_t)
    if paged_step:
        with _last_step_lock:
            _last_step = (key, made)
    return made


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, window):
        o, m, l = _forward(q, k, v, cu_q, cu_k, None, None, scale, causal, window, paged=False)
        ctx.save_for_backward(q, k, v, m, l)
        ctx.args = (cu_q, cu_k, scale, causal, window)
        return o

    @staticmethod
    @first_order_only("attention")
    def backward(ctx, do):
        q, k, v, m, l = ctx.saved_tensors
        cu_q, cu_k, scale, causal, window = ctx.args
        do = do.contiguous()
        tq, hq, d = q.shape
        hkv = k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = torch.zeros_like(m)
        cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=q.device)
        cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=q.device)
        block_q = bwd_block_q(q.dtype)
        common = dict(CAUSAL=causal, HAS_WINDOW=window is not None, PRECISION=dot_precision(q.dtype), BLOCK_Q=block_q,
                      BLOCK_K=KEY_BLOCK, BLOCK_D=triton.next_power_of_2(d))
        lq = [cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)]
        bseq, bq0 = _blocks(lq, block_q, q.device)
        if bseq.numel():
            attn_bwd_dq_kernel[(bseq.numel(), hq)](q, k, v, do, m, l, dq, delta, bseq, bq0, cu_q_t, cu_k_t, hq, hkv, d,
                                                   scale, window or 0, q.stride(0), q.stride(1), k.stride(0),
                                                   k.stride(1), bseq.numel(), **common)
        lk = [cu_k[i + 1] - cu_k[i] if lq[i] else 0 for i in range(len(cu_k) - 1)]
        kseq, kk0 = _blocks(lk, KEY_BLOCK, q.device)
        if kseq.numel():
            attn_bwd_dkdv_kernel[(kseq.numel(), hkv)](q, k, v, do, m, l, delta, dk, dv, kseq, kk0, cu_q_t, cu_k_t, hq,
                                                      hkv, d, scale, window or 0, q.stride(0), q.stride(1),
                                                      k.stride(0), k.stride(1), kseq.numel(), **common)
        return dq, dk, dv, None, None, None, None, None


@register("triton", "attention")
def attention(q, k, v, cu_q, cu_k, scale, causal, window):
    return _Attention.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, scale, causal, window)


@register("triton", "paged_attention")
def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window, *, on_device=None):
    """on_device: the step's (cu_seqlens_q, seq_lens, block_table) as int32 tensors on q's device
    (paged_cache.StepHost.indices32), beside the host values: when every sequence decodes one
    token the kernel reads them where they are, with nothing copied from the host (what a captured
    CUDA graph needs)."""
    with torch.no_grad():
        lens = seq_lens if isinstance(seq_lens, tuple) else list(seq_lens)
        o, _, _ = _forward(q.contiguous(), k_cache, v_cache, cu_q, None, lens, block_table, scale, causal, window,
                           paged=True, on_device=on_device)
    return o
