"""Portable attention: fixed key blocks anchored at key 0, online softmax in block order.

Sequences with the same number of queries are processed together as a group (batched GEMMs
whose entries do not depend on the batch count); within a sequence, its query rows (query token i, head g of a kv group) are
laid out as [kv_heads, len_q * group, head_dim]. For every block of KEY_BLOCK keys, in order from
key 0, the scores come from the row-tiled GEMM, masked entries become -inf, and each row's running
max, sum and output are updated. A query's arithmetic is therefore a function of its own position
and its sequence's keys alone: the same for one query (decode) as for many (prefill), for any chunk
split and any batch. Blocks a row cannot see are skipped; processing them would be an exact no-op
(x * 1 + 0), so skipping changes no bit. See docs/adr/0002-attention-reduction-order.md.

The backward recomputes probabilities from the saved max and sum; dq accumulates over key blocks
in order, and dk, dv of a key block reduce over query rows in 32-row leaves added pairwise
(fixed_order.pairwise_weight_grad, docs/adr/0033). No atomics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics.fixed_order import KEY_BLOCK, accumulate_dtype, exp, matmul_rows, pairwise_weight_grad, row_sum
from ...numerics.cpu_kernels import CpuKernels
from ...paged_cache import gather_packed
from ...registry import register
from ...numerics.second_order import first_order_only


def _rows(x: Tensor, hkv: int) -> Tensor:
    """[S, n, Hq, D] -> [S * Hkv, n * G, D] with rows ordered (token, head-in-group)."""
    s, n, hq, d = x.shape
    return x.reshape(s, n, hkv, hq // hkv, d).permute(0, 2, 1, 3, 4).reshape(s * hkv, n * (hq // hkv), d)


def _unrows(x: Tensor, s: int, n: int, hq: int) -> Tensor:
    sh, _, d = x.shape
    hkv = sh // s
    return x.reshape(s, hkv, n, hq // hkv, d).permute(0, 2, 1, 3, 4).reshape(s, n, hq, d)


def _key_block(x: Tensor, start: int) -> Tensor:
    """Keys [start, start + KEY_BLOCK) of [S, L, Hkv, D], zero-padded, as [S * Hkv, KEY_BLOCK, D]."""
    blk = x[:, start:start + KEY_BLOCK]
    if blk.shape[1] < KEY_BLOCK:
        pad = blk.new_zeros((blk.shape[0], KEY_BLOCK - blk.shape[1]) + tuple(blk.shape[2:]))
        blk = torch.cat([blk, pad], dim=1)
    return blk.permute(0, 2, 1, 3).reshape(-1, KEY_BLOCK, blk.shape[-1])


class _Plan:
    """A group of S sequences with the same number of queries len_q: the positions of their query
    rows and, per key block, the rows that some sequence's row can see."""

    def __init__(self, len_q: int, len_k: list[int], hkv: int, group: int, causal: bool, window: int | None, device,
                 mask: Tensor | None = None):
        self.mask = mask                                                    # [S, len_q, max_k] bool or None
        self.len_k = torch.tensor(len_k, device=device)
        self.max_k, self.causal, self.window, self.group, self.hkv = max(len_k), causal, window, group, hkv
        first = self.len_k - len_q                                          # [S]
        self.pos = (first[:, None] + torch.arange(len_q, device=device)).repeat_interleave(group, dim=1)  # [S, R]
        self.first_min, self.first_max = int(first.min()), int(first.max())
        self.rows = len_q * group

    def blocks(self) -> list[tuple[int, int, int]]:
        """(key start, first row, end row) for each key block some row can see, in key order.

        Rows outside [first row, end row) see nothing in the block; for rows inside the range that
        see nothing, the update is an exact no-op, so the grouping changes no bit."""
        out = []
        for start in range(0, self.max_k, KEY_BLOCK):
            lo, hi = 0, self.rows
            if self.mask is not None:
                if bool(self.mask[:, :, start:start + KEY_BLOCK].any()):
                    out.append((start, lo, hi))
                continue
            if self.causal:
                lo = max(0, start - self.first_max) * self.group
            if self.window is not None:
                last_pos = start + KEY_BLOCK - 2 + self.window
                hi = min(self.rows, max(0, last_pos - self.first_min + 1) * self.group)
            if lo < hi:
                out.append((start, lo, hi))
        return out

    def visible(self, start: int, lo: int, hi: int) -> Tensor:
        """[S * Hkv, hi - lo, KEY_BLOCK] bool: which keys of the block each row may attend to."""
        keys = start + torch.arange(KEY_BLOCK, device=self.pos.device)
        pos = self.pos[:, lo:hi, None]                                       # [S, r, 1]
        mask = (keys[None, None, :] < self.len_k[:, None, None]).expand(pos.shape[0], hi - lo, KEY_BLOCK)
        if self.causal:
            mask = mask & (keys[None, None, :] <= pos)
        if self.window is not None:
            mask = mask & (keys[None, None, :] > pos - self.window)
        if self.mask is not None:
            explicit = self.mask[:, :, start:start + KEY_BLOCK]
            if explicit.shape[-1] < KEY_BLOCK:
                explicit = torch.nn.functional.pad(explicit, (0, KEY_BLOCK - explicit.shape[-1]))
            mask = mask & explicit.repeat_interleave(self.group, dim=1)[:, lo:hi]
        return mask.repeat_interleave(self.hkv, dim=0)


def _scores(qrows: Tensor, kblk: Tensor, scale: float, visible: Tensor, kernels: CpuKernels | None) -> Tensor:
    s = matmul_rows(qrows, kblk.transpose(1, 2), kernels=kernels) * scale
    return torch.where(visible, s, torch.full_like(s, float("-inf")))


def group_forward(q: Tensor, k: Tensor, v: Tensor, len_k: list[int], scale: float, causal: bool,
                  window: int | None, mask: Tensor | None = None, *,
                  kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    """S sequences with equal len_q: q [S, len_q, Hq, D]; k, v [S, max len_k, Hkv, D] (zero past each
    sequence's len_k) in the accumulation dtype. mask: optional [S, len_q, max_k] bool, True where a
    query may attend (an explicit mask, as scaled_dot_product_attention takes); a row that may
    attend to nothing gets a zero output. The GEMMs, exp and sums run on the CPU kernels `kernels`
    (None: PyTorch's).

    Returns (output [S, len_q, Hq, D], softmax statistics [2, S * Hkv, len_q * G]: the running max
    and the sum of exponentials). Backward recomputes probabilities as exp(s - max) / sum:
    exp(s - logsumexp) would amplify the rounding of logsumexp into every one."""
    s_count, len_q, hq, d = q.shape
    hkv = k.shape[2]
    plan = _Plan(len_q, len_k, hkv, hq // hkv, causal, window, q.device, mask)
    qr = _rows(q, hkv)
    run_max = torch.full((s_count * hkv, plan.rows), float("-inf"), dtype=q.dtype, device=q.device)
    run_sum = torch.zeros((s_count * hkv, plan.rows), dtype=q.dtype, device=q.device)
    acc = torch.zeros((s_count * hkv, plan.rows, d), dtype=q.dtype, device=q.device)
    for start, lo, hi in plan.blocks():
        s = _scores(qr[:, lo:hi], _key_block(k, start), scale, plan.visible(start, lo, hi), kernels)
        old = run_max[:, lo:hi]
        new = torch.maximum(old, torch.amax(s, dim=-1))
        # A row that has seen no key yet keeps max -inf; shift by 0 so exp gives 0, never NaN.
        shift = torch.where(new == float("-inf"), torch.zeros_like(new), new)
        alpha = exp(old - shift, kernels=kernels)
        p = exp(s - shift[..., None], kernels=kernels)
        run_sum[:, lo:hi] = run_sum[:, lo:hi] * alpha + row_sum(p, kernels=kernels)
        acc[:, lo:hi] = acc[:, lo:hi] * alpha[..., None] + matmul_rows(p, _key_block(v, start), kernels=kernels)
        run_max[:, lo:hi] = new
    # A row that saw no key (fully masked) outputs zeros, not 0/0: a NaN there could reach other rows
    # through 0 * NaN in their P @ V.
    out = acc / torch.where(run_sum == 0, torch.ones_like(run_sum), run_sum)[..., None]
    return _unrows(out, s_count, len_q, hq), torch.stack([run_max, run_sum])


def sequence_backward(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, stats: Tensor,
                      scale: float, causal: bool, window: int | None,
                      mask: Tensor | None = None, *,
                      kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one sequence (all in the accumulation dtype): dq [len_q, Hq, D], dk, dv [len_k, Hkv, D],
    on the CPU kernels `kernels` (None: PyTorch's).

    Two passes over the key blocks. The first accumulates delta = sum_j p_j dp_j from the same dp
    values the second uses, so that dp - delta cancels exactly where it should (a query that sees
    one key); the usual rowsum(dO * O) sums in another order and leaves a rounding residue that the
    gradient then amplifies.
    """
    len_q, hq, d = q.shape
    len_k, hkv, _ = k.shape
    plan = _Plan(len_q, [len_k], hkv, hq // hkv, causal, window, q.device, None if mask is None else mask[None])
    qr, dor = _rows(q[None], hkv), _rows(grad_out[None], hkv)
    kk, vv = k[None], v[None]
    run_max, run_sum = stats[0], stats[1]
    shift = torch.where(run_max == float("-inf"), torch.zeros_like(run_max), run_max)

    def probs_and_dp(start: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        s = _scores(qr[:, lo:hi], _key_block(kk, start), scale, plan.visible(start, lo, hi), kernels)
        p = exp(s - shift[:, lo:hi, None], kernels=kernels) / torch.where(run_sum == 0, 1.0, run_sum)[:, lo:hi, None]
        return p, matmul_rows(dor[:, lo:hi], _key_block(vv, start).transpose(1, 2), kernels=kernels)

    blocks = plan.blocks()
    delta = torch.zeros_like(run_sum)
    for start, lo, hi in blocks:
        p, dp = probs_and_dp(start, lo, hi)
        delta[:, lo:hi] = delta[:, lo:hi] + row_sum(p * dp, kernels=kernels)
    dq = torch.zeros_like(qr)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for start, lo, hi in blocks:
        p, dp = probs_and_dp(start, lo, hi)
        n = min(KEY_BLOCK, len_k - start)
        dv[start:start + n] = pairwise_weight_grad(p, dor[:, lo:hi], kernels=kernels).permute(1, 0, 2)[:n]
        ds = p * (dp - delta[:, lo:hi, None])
        dq[:, lo:hi] = dq[:, lo:hi] + matmul_rows(ds, _key_block(kk, start), kernels=kernels) * scale
        dk[start:start + n] = (pairwise_weight_grad(ds, qr[:, lo:hi], kernels=kernels) * scale).permute(1, 0, 2)[:n]
    return _unrows(dq, 1, len_q, hq)[0], dk, dv


def _grouped_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int], scale: float, causal: bool,
                     window: int | None, acc: torch.dtype,
                     kernels: CpuKernels | None) -> tuple[Tensor, list[Tensor | None]]:
    """Packed sequences, grouped by their number of queries; per-sequence softmax statistics."""
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    stats: list[Tensor | None] = [None] * (len(cu_q) - 1)
    groups: dict[int, list[int]] = {}
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] > cu_q[b]:
            groups.setdefault(cu_q[b + 1] - cu_q[b], []).append(b)
    hkv = k.shape[1]
    for n, members in groups.items():
        lens = [cu_k[b + 1] - cu_k[b] for b in members]
        ks = k.new_zeros((len(members), max(lens)) + tuple(k.shape[1:]), dtype=acc)
        vs = torch.zeros_like(ks)
        for i, b in enumerate(members):
            ks[i, :lens[i]] = k[cu_k[b]:cu_k[b + 1]]
            vs[i, :lens[i]] = v[cu_k[b]:cu_k[b + 1]]
        qs = torch.stack([q[cu_q[b]:cu_q[b + 1]] for b in members]).to(acc)
        o, st = group_forward(qs, ks, vs, lens, scale, causal, window, kernels=kernels)
        for i, b in enumerate(members):
            out[cu_q[b]:cu_q[b + 1]] = o[i]
            stats[b] = st[:, i * hkv:(i + 1) * hkv]
    return out, stats


class _Attention(torch.autograd.Function):
    """Packed attention (q, k, v, cu_q, cu_k, scale, causal, window, kernels): `_grouped_forward`,
    and `packed_backward` on the CPU kernels the forward ran with."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, window, kernels):
        out, stats = _grouped_forward(q, k, v, cu_q, cu_k, scale, causal, window, accumulate_dtype(q.dtype), kernels)
        ctx.save_for_backward(q, k, v)
        ctx.stats, ctx.cu_q, ctx.cu_k = stats, cu_q, cu_k
        ctx.options, ctx.kernels = (scale, causal, window), kernels
        return out.to(q.dtype)

    @staticmethod
    @first_order_only("attention")
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        return packed_backward(q, k, v, grad_out, ctx.stats, ctx.cu_q, ctx.cu_k, *ctx.options,
                               kernels=ctx.kernels) + (None,) * 6


def packed_backward(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, stats: list[Tensor | None], cu_q: list[int],
                    cu_k: list[int], scale: float, causal: bool, window: int | None, *,
                    kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (in q's, k's, v's dtype) of packed sequences, from each sequence's forward
    statistics ([2, Hkv, len_q * G]: the running max and sum, rows ordered (token, head in group);
    None for a sequence without queries), one sequence at a time (`sequence_backward`, on the CPU
    kernels `kernels`)."""
    acc = accumulate_dtype(q.dtype)
    g = grad_out.to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for b, stat in enumerate(stats):
        if stat is None:
            continue
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        gq, gk, gv = sequence_backward(q[q0:q1].to(acc), k[k0:k1].to(acc), v[k0:k1].to(acc), g[q0:q1],
                                       stat, scale, causal, window, kernels=kernels)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = gq, gk, gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@register("portable", "attention")
def attention(q, k, v, cu_q, cu_k, scale, causal, window, *, kernels: CpuKernels | None = None):
    """The portable packed attention, its GEMMs, exp and sums on the CPU kernels `kernels` (None: PyTorch's)."""
    return _Attention.apply(q, k, v, cu_q, cu_k, scale, causal, window, kernels)


@register("portable", "paged_attention")
def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window, *,
                    kernels: CpuKernels | None = None, on_device=None):
    """Each sequence's keys are read through its block table; then the packed kernel runs, which
    groups sequences with the same number of new tokens (all decode tokens, say), on the CPU
    kernels `kernels` (None: PyTorch's)."""
    acc = accumulate_dtype(q.dtype)
    with torch.no_grad():
        cu_k = [0]
        for n in seq_lens:
            cu_k.append(cu_k[-1] + n)
        k = gather_packed(k_cache, block_table, seq_lens)
        v = gather_packed(v_cache, block_table, seq_lens)
        out, _ = _grouped_forward(q, k, v, cu_q, cu_k, scale, causal, window, acc, kernels)
    return out.to(q.dtype)
