"""Native attention: the forward is lockstep's own kernel (attention.c, `ls_attention_fwd`), which
reads a paged KV cache through its block table in place (docs/adr/0016-native-attention.md); the
backward is another (attention_backward.c, `ls_attention_bwd`), from the forward's softmax
statistics (docs/adr/0022-native-attention-backward.md).

The kernel computes each query row on its own, in 64-key blocks anchored at key 0, so a query's
bits do not depend on the other queries of its call: one query (decode) gives the same bits as
the same query inside a prefill or a chunk, packed or paged, and every instruction set and thread
count gives the same bits too. float64 takes the portable op.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor

from ...registry import register
from ...numerics.second_order import first_order_only
from ..portable import attention as portable
from .build import isa, library
from . import cpu
from .gemm import DTYPE_CODES


def _int64(values) -> Tensor:
    return torch.as_tensor(values, dtype=torch.int64).contiguous()


def attention_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Sequence[int], len_k: Sequence[int],
                      k_start: list[int] | None, table: Tensor | None, scale: float, causal: bool,
                      window: int | None, mask: Tensor | None = None,
                      indices: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q [Tq, Hq, D]; k, v [Tk, Hkv, D] packed (sequence b's keys from row k_start[b]), a paged cache
    [num_blocks, block_size, Hkv, D] read through table [B, max_blocks], or, with `mask`,
    [B, Hkv, Lk, D] (sequence b's keys in k[b], read in place through its strides); fp32, bf16 or
    fp16. mask: [Tq, Lk] bool, the keys each query row may see (its blocks start at the first).
    indices: cu_q and len_k as the kernel reads them (int64 tensors), when the caller has them.
    Returns fp32 (out [Tq, Hq, D], row max [Tq, Hq], row sum of exponentials [Tq, Hq]); rows past
    cu_q[-1] are zero."""
    q, k, v = _computed(q, k, v)
    q = q.contiguous()
    if mask is None or k.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    tq, hq, d = q.shape
    hkv = k.shape[1] if mask is not None else k.shape[-2]
    # ls_attention starts every row below cu_q[-1] itself; only padding rows past it are filled here.
    out = torch.empty((tq, hq, d), dtype=torch.float32)
    row_max, row_sum = torch.empty((tq, hq)), torch.empty((tq, hq))
    if cu_q[-1] < tq:
        out[cu_q[-1]:], row_max[cu_q[-1]:], row_sum[cu_q[-1]:] = 0.0, float("-inf"), 0.0
    if out.numel() == 0:  # no heads, no head dims or no queries: nothing to compute
        return out, row_max, row_sum
    if mask is not None:                                  # [B, Hkv, Lk, D]: batch b's keys at k[b]
        kv_token, kv_head = k.stride(2), k.stride(1)
        offsets = [b * k.stride(0) for b in range(k.shape[0])]
        mask = mask.contiguous()
    else:                                                 # [..., Hkv, D] rows
        kv_token, kv_head = hkv * d, d
        offsets = None if k_start is None else [s * kv_token for s in k_start]
    cu, lens = indices if indices is not None else (_int64(cu_q), _int64(len_k))
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


def _computed(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the kernels take them: one dtype of theirs (else fp32)."""
    if not (q.dtype == k.dtype == v.dtype and q.dtype in DTYPE_CODES):
        return q.float(), k.float(), v.float()
    return q, k, v


def attention_backward(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, row_max: Tensor, row_sum: Tensor,
                       cu_q: list[int], len_k: list[int], k_start: list[int] | None, scale: float, causal: bool,
                       window: int | None, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of `attention_forward` (without a block table), from its row max and row sum
    ([Tq, Hq] fp32): q, k, v, cu_q, len_k, k_start, scale, causal, window and mask as it took them,
    grad_out [Tq, Hq, D]. Returns fp32 dq (q's shape) and dk, dv (k's shape)."""
    q, k, v = (t.contiguous() for t in _computed(q, k, v))
    g = grad_out.to(q.dtype).contiguous()
    tq, hq, d = q.shape
    dq = torch.zeros((tq, hq, d), dtype=torch.float32)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    if dq.numel() == 0 or dk.numel() == 0:  # no heads, no head dims, no queries or no keys
        return dq, dk, dv
    if mask is not None:                   # [B, Hkv, Lk, D]: batch b's keys at k[b]
        kv_token, kv_head = k.stride(2), k.stride(1)
        offsets = [b * k.stride(0) for b in range(k.shape[0])]
        mask = mask.contiguous()
    else:                                  # [Tk, Hkv, D] rows
        kv_token, kv_head = k.stride(0), k.stride(1)
        offsets = [s * kv_token for s in k_start]
    delta = torch.empty((tq, hq))
    cu, lens, starts = _int64(cu_q), _int64(len_k), _int64(offsets)
    row_max, row_sum = row_max.contiguous(), row_sum.contiguous()
    status = library().ls_attention_bwd(
        len(len_k), hq, k.shape[1], d, q.data_ptr(), k.data_ptr(), v.data_ptr(),
        g.data_ptr(), kv_token, kv_head, cu.data_ptr(), lens.data_ptr(), starts.data_ptr(),
        None if mask is None else mask.data_ptr(), 0 if mask is None else mask.shape[-1], scale, int(causal),
        window or 0, row_max.data_ptr(), row_sum.data_ptr(), delta.data_ptr(), dq.data_ptr(), dk.data_ptr(),
        dv.data_ptr(), DTYPE_CODES[q.dtype], isa(), torch.get_num_threads())
    if status == -2:
        raise MemoryError("ls_attention_bwd: out of memory for its work buffers")
    if status != 0:
        raise RuntimeError(f"ls_attention_bwd refused q {tuple(q.shape)}, k {tuple(k.shape)} ({q.dtype})")
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """Packed attention, forward and backward on the native kernels."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal, window):
        lens = [cu_k[b + 1] - cu_k[b] for b in range(len(cu_k) - 1)]
        out, row_max, row_sum = attention_forward(q, k, v, cu_q, lens, cu_k[:-1], None, scale, causal, window)
        ctx.save_for_backward(q, k, v, row_max, row_sum)
        ctx.options = (cu_q, lens, cu_k[:-1], scale, causal, window)
        return out.to(q.dtype)

    @staticmethod
    @first_order_only("attention")
    def backward(ctx, grad_out):
        q, k, v, row_max, row_sum = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, grad_out, row_max, row_sum, *ctx.options)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 5


@register("native", "attention")
def attention(q, k, v, cu_q, cu_k, scale, causal, window):
    if q.dtype == torch.float64:
        return portable.attention(q, k, v, cu_q, cu_k, scale, causal, window, kernels=cpu.KERNELS)
    return _Attention.apply(q, k, v, list(cu_q), list(cu_k), scale, causal, window)


@register("native", "paged_attention")
def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window, *, on_device=None):
    if q.dtype == torch.float64:
        return portable.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window,
                                        kernels=cpu.KERNELS)
    with torch.no_grad():
        out, _, _ = attention_forward(q, k_cache, v_cache, cu_q, seq_lens, None, block_table, scale, causal, window,
                                      indices=_step_indices(cu_q, seq_lens, on_device))
    return out.to(q.dtype)


# The last paged call's int64 cu_q and seq_lens. A step's layers pass the same tuples (build_step's
# host copy, immutable), so they are made once per step rather than once per layer.
_last_indices: tuple = ((), (), None)
_last_indices_lock = threading.Lock()


def _step_indices(cu_q: Sequence[int], seq_lens: Sequence[int],
                  on_device: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """cu_q and seq_lens as int64 tensors, reused for the same tuples: widened from build_step's
    int32 copies (`on_device`, paged_cache.StepHost.indices32) where the step has them, so that a
    captured step (engine/step_graph.py) makes them again from its buffer; else from the tuples."""
    global _last_indices
    with _last_indices_lock:
        last_cu, last_lens, made = _last_indices
    if made is not None and cu_q is last_cu and seq_lens is last_lens:
        return made
    if on_device is not None and on_device[0].device.type == "cpu":
        made = (on_device[0].to(torch.int64), on_device[1].to(torch.int64))
    else:
        made = (_int64(list(cu_q)), _int64([int(n) for n in seq_lens]))
    if isinstance(cu_q, tuple) and isinstance(seq_lens, tuple):
        with _last_indices_lock:
            _last_indices = (cu_q, seq_lens, made)
    return made
