"""Native masked attention: the portable op, with its GEMMs, exp and log on lockstep's own kernels
(cpu.py)."""

from __future__ import annotations

from ...registry import register
from ..portable import masked_attention as portable
from .cpu import native_kernels


@register("native", "masked_attention")
def masked_attention(q, k, v, visible, scale):
    with native_kernels():
        return portable.masked_attention(q, k, v, visible, scale)
