"""Native attention: the forward is lockstep's own kernel (kernels.c, `ls_attention_fwd`), which reads
a paged KV cache through its block table in place; the backward is the portable op's, on the native
GEMMs, exp and log, from the forward's softmax statistics (docs/adr/0016-native-attention.md).

The kernel computes each query row on its own, in 64-key blocks anchored at key 0, so a query's
bits do not depend on the other queries of its call: one query (decode) gives the same bits as
the same query inside a prefill or a chunk, packed or paged, and every instruction set and thread
count gives the same bits too. float64 takes the portable op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from ..portable import attention as portable
from .build import isa, library
from .cpu import native_kernels
from .gemm import DTYPE_CODES


def _int64(values) -> Tensor:
    return torch.as_tensor(values, dtype=torch.int64).contiguous()


def attention_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], len_k: list[int],
                      k_start: list[int] | None, table: Tensor | None, scale: float, causal: bool,
                      window: int | None, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q [Tq, Hq, D]; k, v [Tk, Hkv, D] packed (sequence b's keys from row k_start[b]), a paged cache
    [num_blocks, block_size, Hkv, D] read through table [B, max_blocks], or, with `mask`,
    [B, Hkv, Lk, D] (sequence b's keys in k[b], read in place through its strides); fp32, bf16 or
    fp16. mask: [Tq, Lk] bool, the keys each query row may see (its blocks start at the first).
    Returns fp32 (out [Tq, Hq, D], row max [Tq, Hq], row sum of exponentials [Tq, Hq]); rows past
    cu_q[-1] are zero."""
    if not (q.dtype == k.dtype == v.dtype and q.dtype in DTYPE_CODES):
        q, k, v = q.float(), k.float(), v.float()
    q = q.contiguous()
    if mask is None or k.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    tq, hq, d = q.shape
    hkv = k.shape[1] if mask is not None else k.shape[-2]
    out = torch.zeros((tq, hq, d), dtype=torch.float32)
    row_max = torch.full((tq, hq), float("-inf"))
    row_sum = torch.zeros((tq, hq))
    if out.numel() == 0:  # no heads, no head dims or no queries: nothing to compute
        return out, row_max, row_sum
    if mask is not None:                                  # [B, Hkv, Lk, D]: batch b's keys at k[b]
        kv_token, kv_head = k.stride(2), k.stride(1)
        offsets = [b * k.stride(0) for b in range(k.shape[0])]
        mask = mask.contiguous()
    else:                                                 # [..., Hkv, D] rows
        kv_token, kv_head = hkv * d, d
        offsets = None if k_start is None else [s * kv_token for s in k_start]
    cu, lens = _int64(cu_q), _int64(len_k)
    starts = None if offsets is None else _int64(offsets)
    tbl = None if table is None else table.to(torch.int64).contiguous()
    status = library().ls_attention_fwd(
        len(len_k), hq, hkv, d, q.data_ptr(), k.data_ptr(), v.data_ptr(), kv_token, kv_head, cu.data_ptr(),
        lens.data_ptr(), None if starts is None else starts.data_ptr(), None if tbl is None else tbl.data_ptr(),
        0 if tbl is None else tbl.stride(0), 0 if tbl is None else k.shape[1],
        None if mask is None else mask.data_ptr(), 0 if mask is None else mask.shape[-1], scale, int(causal),
        window or 0, out.data_ptr(), row_max.data_ptr(), row_sum.data_ptr(), DTYPE_CODES[q.dtype], isa(),
        torch.get_num_threads())
    if status == -2:
        raise MemoryError("ls_attention_fwd: out of memory for its key-block buffers")
    if status != 0:
        raise RuntimeError(f"ls_attention_fwd refused q {tuple(q.shape)}, k {tuple(k.shape)} ({q.dtype})")
    return out, row_max, row_sum


def _portable_stats(row_max: Tensor, row_sum: Tensor, q0: int, q1: int, hkv: int) -> Tensor:
    """One sequence's statistics in the portable backward's layout: [2, Hkv, len_q * G], rows
    ordered (token, head in group)."""
    n, hq = q1 - q0, row_max.shape[1]
    return torch.stack([x[q0:q1].reshape(n, hkv, hq // hkv).permute(1, 0, 2).reshape(hkv, -1)
                        for x in (row_max, row_sum)])


def _packed_forward(q, k, v, cu_q, cu_k, scale, causal, window) -> tuple[Tensor, list[Tensor | None]]:
    """The kernel's output and each sequence's statistics in the portable backward's layout."""
    lens = [cu_k[b + 1] - cu_k[b] for b in range(len(cu_k) - 1)]
    out, row_max, row_sum = attention_forward(q, k, v, cu_q, lens, cu_k[:-1], None, scale, causal, window)
    return out, [_portable_stats(row_max, row_sum, cu_q[b], cu_q[b + 1], k.shape[1]) if cu_q[b + 1] > cu_q[b]
                 else None for b in range(len(cu_q) - 1)]


_Attention = portable.packed_attention_function(_packed_forward)


@register("native", "attention")
def attention(q, k, v, cu_q, cu_k, scale, causal, window):
    with native_kernels():
        if q.dtype == torch.float64:
            return portable.attention(q, k, v, cu_q, cu_k, scale, causal, window)
        return _Attention.apply(q, k, v, list(cu_q), list(cu_k), scale, causal, window)


@register("native", "paged_attention")
def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window):
    with native_kernels():
        if q.dtype == torch.float64:
            return portable.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window)
        with torch.no_grad():
            out, _, _ = attention_forward(q, k_cache, v_cache, list(cu_q), [int(n) for n in seq_lens], None,
                                          block_table, scale, causal, window)
        return out.to(q.dtype)
