"""Portable attention: fixed key blocks anchored at key 0, online softmax in block order.

Each sequence is processed on its own. Its query rows (query token i, head g of a kv group) are
laid out as [kv_heads, len_q * group, head_dim]. For every block of KEY_BLOCK keys, in order from
key 0, the scores come from the row-tiled GEMM, masked entries become -inf, and each row's running
max, sum and output are updated. A query's arithmetic is therefore a function of its own position
and its sequence's keys alone: the same for one query (decode) as for many (prefill), for any chunk
split and any batch. Blocks a row cannot see are skipped; processing them would be an exact no-op
(x * 1 + 0), so skipping changes no bit. See docs/adr/0002-attention-reduction-order.md.

The backward recomputes probabilities from the saved max and sum; dq accumulates over key blocks
in order, and dk, dv of a key block reduce over query rows in fixed row blocks. No atomics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import register
from .fixed_order import accumulate_dtype, matmul_rows, row_sum, weight_grad

KEY_BLOCK = 64


def _rows(x: Tensor, hkv: int) -> Tensor:
    """[n, Hq, D] -> [Hkv, n * G, D] with rows ordered (token, head-in-group)."""
    n, hq, d = x.shape
    return x.reshape(n, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, n * (hq // hkv), d)


def _unrows(x: Tensor, n: int, hq: int) -> Tensor:
    hkv, _, d = x.shape
    return x.reshape(hkv, n, hq // hkv, d).permute(1, 0, 2, 3).reshape(n, hq, d)


def _key_block(x: Tensor, start: int) -> Tensor:
    """Keys [start, start + KEY_BLOCK) of [L, Hkv, D], zero-padded, as [Hkv, KEY_BLOCK, D]."""
    blk = x[start:start + KEY_BLOCK]
    if blk.shape[0] < KEY_BLOCK:
        blk = torch.cat([blk, blk.new_zeros((KEY_BLOCK - blk.shape[0],) + tuple(blk.shape[1:]))])
    return blk.permute(1, 0, 2)


class _Plan:
    """Positions of one sequence's query rows and, per key block, the rows that can see it."""

    def __init__(self, len_q: int, len_k: int, group: int, causal: bool, window: int | None, device):
        self.len_k, self.causal, self.window, self.group = len_k, causal, window, group
        first = len_k - len_q
        self.pos = (first + torch.arange(len_q, device=device)).repeat_interleave(group)
        self.first, self.rows = first, len_q * group

    def blocks(self) -> list[tuple[int, int, int]]:
        """(key start, first row, end row) for each key block some row can see, in key order."""
        out = []
        for start in range(0, self.len_k, KEY_BLOCK):
            lo, hi = 0, self.rows
            if self.causal:
                lo = max(0, start - self.first) * self.group
            if self.window is not None:
                # rows with pos - window < start + KEY_BLOCK - 1, i.e. pos <= start + KEY_BLOCK - 2 + window
                last_pos = start + KEY_BLOCK - 2 + self.window
                hi = min(self.rows, max(0, last_pos - self.first + 1) * self.group)
            if lo < hi:
                out.append((start, lo, hi))
        return out

    def visible(self, start: int, lo: int, hi: int) -> Tensor:
        keys = start + torch.arange(KEY_BLOCK, device=self.pos.device)
        pos = self.pos[lo:hi, None]
        mask = (keys < self.len_k)[None, :].expand(hi - lo, KEY_BLOCK)
        if self.causal:
            mask = mask & (keys[None, :] <= pos)
        if self.window is not None:
            mask = mask & (keys[None, :] > pos - self.window)
        return mask


def _scores(qrows: Tensor, kblk: Tensor, scale: float, visible: Tensor) -> Tensor:
    s = matmul_rows(qrows, kblk.transpose(1, 2)) * scale
    return torch.where(visible, s, torch.full_like(s, float("-inf")))


def sequence_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                     window: int | None) -> tuple[Tensor, Tensor]:
    """One sequence: q [len_q, Hq, D], k, v [len_k, Hkv, D] in the accumulation dtype.

    Returns (output [len_q, Hq, D], softmax statistics [2, Hkv, len_q * G]: the running max and the
    sum of exponentials) in the accumulation dtype. Backward recomputes probabilities as
    exp(s - max) / sum: exp(s - logsumexp) would amplify the rounding of logsumexp into every one."""
    len_q, hq, d = q.shape
    hkv = k.shape[1]
    plan = _Plan(len_q, k.shape[0], hq // hkv, causal, window, q.device)
    qr = _rows(q, hkv)
    run_max = torch.full((hkv, plan.rows), float("-inf"), dtype=q.dtype, device=q.device)
    run_sum = torch.zeros((hkv, plan.rows), dtype=q.dtype, device=q.device)
    acc = torch.zeros((hkv, plan.rows, d), dtype=q.dtype, device=q.device)
    for start, lo, hi in plan.blocks():
        s = _scores(qr[:, lo:hi], _key_block(k, start), scale, plan.visible(start, lo, hi))
        old = run_max[:, lo:hi]
        new = torch.maximum(old, torch.amax(s, dim=-1))
        # A row that has seen no key yet keeps max -inf; shift by 0 so exp gives 0, never NaN.
        shift = torch.where(new == float("-inf"), torch.zeros_like(new), new)
        alpha = torch.exp(old - shift)
        p = torch.exp(s - shift[..., None])
        run_sum[:, lo:hi] = run_sum[:, lo:hi] * alpha + row_sum(p)
        acc[:, lo:hi] = acc[:, lo:hi] * alpha[..., None] + matmul_rows(p, _key_block(v, start))
        run_max[:, lo:hi] = new
    out = acc / run_sum[..., None]
    return _unrows(out, len_q, hq), torch.stack([run_max, run_sum])


def sequence_backward(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, stats: Tensor,
                      scale: float, causal: bool, window: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one sequence (all in the accumulation dtype): dq [len_q, Hq, D], dk, dv [len_k, Hkv, D].

    Two passes over the key blocks. The first accumulates delta = sum_j p_j dp_j from the same dp
    values the second uses, so that dp - delta cancels exactly where it should (a query that sees
    one key); the usual rowsum(dO * O) sums in another order and leaves a rounding residue that the
    gradient then amplifies.
    """
    len_q, hq, d = q.shape
    len_k, hkv, _ = k.shape
    plan = _Plan(len_q, len_k, hq // hkv, causal, window, q.device)
    qr, dor = _rows(q, hkv), _rows(grad_out, hkv)
    run_max, run_sum = stats[0], stats[1]
    shift = torch.where(run_max == float("-inf"), torch.zeros_like(run_max), run_max)

    def probs_and_dp(start: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        s = _scores(qr[:, lo:hi], _key_block(k, start), scale, plan.visible(start, lo, hi))
        p = torch.exp(s - shift[:, lo:hi, None]) / run_sum[:, lo:hi, None]
        return p, matmul_rows(dor[:, lo:hi], _key_block(v, start).transpose(1, 2))

    blocks = plan.blocks()
    delta = torch.zeros_like(run_sum)
    for start, lo, hi in blocks:
        p, dp = probs_and_dp(start, lo, hi)
        delta[:, lo:hi] = delta[:, lo:hi] + row_sum(p * dp)
    dq = torch.zeros_like(qr)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for start, lo, hi in blocks:
        p, dp = probs_and_dp(start, lo, hi)
        n = min(KEY_BLOCK, len_k - start)
        dv[start:start + n] = weight_grad(p, dor[:, lo:hi]).permute(1, 0, 2)[:n]
        ds = p * (dp - delta[:, lo:hi, None])
        dq[:, lo:hi] = dq[:, lo:hi] + matmul_rows(ds, _key_block(k, start)) * scale
        dk[start:start + n] = (weight_grad(ds, qr[:, lo:hi]) * scale).permute(1, 0, 2)[:n]
    return _unrows(dq, len_q, hq), dk, dv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, window):
        acc = accumulate_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        stats = []
        for b in range(len(cu_q) - 1):
            q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            if q1 == q0:
                stats.append(None)
                continue
            o, stat = sequence_forward(q[q0:q1].to(acc), k[k0:k1].to(acc), v[k0:k1].to(acc), scale, causal, window)
            out[q0:q1] = o
            stats.append(stat)
        ctx.save_for_backward(q, k, v)
        ctx.stats, ctx.cu_q, ctx.cu_k = stats, cu_q, cu_k
        ctx.options = (scale, causal, window)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        acc = accumulate_dtype(q.dtype)
        g = grad_out.to(acc)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        cu_q, cu_k = ctx.cu_q, ctx.cu_k
        for b, stat in enumerate(ctx.stats):
            if stat is None:
                continue
            q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            gq, gk, gv = sequence_backward(q[q0:q1].to(acc), k[k0:k1].to(acc), v[k0:k1].to(acc), g[q0:q1],
                                           stat, *ctx.options)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = gq, gk, gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


@register("portable", "attention")
def attention(q, k, v, cu_q, cu_k, scale, causal, window):
    return _Attention.apply(q, k, v, cu_q, cu_k, scale, causal, window)


def gather_sequence(cache: Tensor, block_table: Tensor, b: int, length: int) -> Tensor:
    """Sequence b's first `length` cached rows [length, Hkv, D], read through its block table."""
    block_size = cache.shape[1]
    blocks = block_table[b, : -(-length // block_size)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


@register("portable", "paged_attention")
def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window):
    acc = accumulate_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    with torch.no_grad():
        for b, length in enumerate(seq_lens):
            q0, q1 = cu_q[b], cu_q[b + 1]
            if q1 == q0:
                continue
            k = gather_sequence(k_cache, block_table, b, length).to(acc)
            v = gather_sequence(v_cache, block_table, b, length).to(acc)
            out[q0:q1] = sequence_forward(q[q0:q1].to(acc), k, v, scale, causal, window)[0]
    return out.to(q.dtype)
