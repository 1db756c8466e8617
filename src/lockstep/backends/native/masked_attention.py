"""Native masked attention: the forward is the attention kernel (kernels.c, `ls_attention_fwd`) under
the explicit mask, each query's blocks anchored at the first key it can see, reading k and v in
place; the backward is the portable op's, on the native GEMMs, exp and log, from the forward's
softmax statistics (docs/adr/0016-native-attention.md). float64 takes the portable op."""

from __future__ import annotations

import torch
from torch import Tensor

from ...fixed_order import log, records_cpu_kernels, restores_cpu_kernels
from ...registry import register
from ..portable import masked_attention as portable
from .attention import attention_forward
from .cpu import native_kernels


def forward(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float
            ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """(out [B, Hq, Lq, D] in q's dtype, logsumexp [B, Hq, Lq] float32, (row max, row sum)
    [B, Lq, Hq] float32)."""
    b, hq, lq, d = q.shape
    lk = k.shape[2]
    rows = q.transpose(1, 2).reshape(b * lq, hq, d)
    out, row_max, row_sum = attention_forward(rows, k, v, [i * lq for i in range(b + 1)], [lk] * b, None, None,
                                              scale, False, None, mask=visible.reshape(b * lq, lk))
    lse = (row_max + log(row_sum)).view(b, lq, hq).transpose(1, 2)    # -inf + log(0): -inf where none is seen
    out = out.view(b, lq, hq, d).transpose(1, 2).to(q.dtype)
    return out, lse, (row_max.view(b, lq, hq), row_sum.view(b, lq, hq))


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    @records_cpu_kernels
    def forward(ctx, q, k, v, visible, scale):
        out, lse, (row_max, row_sum) = forward(q, k, v, visible, scale)
        ctx.save_for_backward(q, k, v, visible, row_max, row_sum)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @restores_cpu_kernels
    def backward(ctx, grad, _grad_lse):
        q, k, v, visible, row_max, row_sum = ctx.saved_tensors
        return (*portable.backward(grad, q, k, v, visible, ctx.scale, (row_max, row_sum)), None, None)


@register("native", "masked_attention")
def masked_attention(q, k, v, visible, scale):
    with native_kernels():
        if q.dtype == torch.float64:
            return portable.masked_attention(q, k, v, visible, scale)
        return _MaskedAttention.apply(q, k, v, visible, scale)
