"""Native attention: the portable op's fixed tiles and orders, with its GEMMs, exp and log on
lockstep's own kernels (cpu.py)."""

from __future__ import annotations

from ...registry import register
from ..portable import attention as portable
from .cpu import native_kernels


@register("native", "attention")
def attention(q, k, v, cu_q, cu_k, scale, causal, window):
    with native_kernels():
        return portable.attention(q, k, v, cu_q, cu_k, scale, causal, window)


@register("native", "paged_attention")
def paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window):
    with native_kernels():
        return portable.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, causal, window)
