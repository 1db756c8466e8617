"""Native masked attention: the attention kernels (`ls_attention_fwd` in attention.c,
`ls_attention_bwd` in attention_backward.c) under the explicit mask, each query's blocks anchored
at the first key it can see; the forward reads k and v in place, the backward starts from its
softmax statistics (docs/adr/0016-native-attention.md, docs/adr/0022-native-attention-backward.md).
float64 takes the portable op."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics.fixed_order import log
from ...registry import register
from ...numerics.second_order import first_order_only
from ..portable import masked_attention as portable
from .attention import attention_backward, attention_forward
from . import cpu


def forward(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float
            ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """(out [B, Hq, Lq, D] in q's dtype, logsumexp [B, Hq, Lq] float32, (row max, row sum)
    [B, Lq, Hq] float32)."""
    b, hq, lq, d = q.shape
    lk = k.shape[2]
    rows = q.transpose(1, 2).reshape(b * lq, hq, d)
    out, row_max, row_sum = attention_forward(rows, k, v, [i * lq for i in range(b + 1)], [lk] * b, None, None,
                                              scale, False, None, mask=visible.reshape(b * lq, lk))
    # -inf + log(0): -inf where none is seen
    lse = (row_max + log(row_sum, kernels=cpu.KERNELS)).view(b, lq, hq).transpose(1, 2)
    out = out.view(b, lq, hq, d).transpose(1, 2).to(q.dtype)
    return out, lse, (row_max.view(b, lq, hq), row_sum.view(b, lq, hq))


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale):
        out, lse, (row_max, row_sum) = forward(q, k, v, visible, scale)
        ctx.save_for_backward(q, k, v, visible, row_max, row_sum)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @first_order_only("masked_attention")
    def backward(ctx, grad, _grad_lse):
        q, k, v, visible, row_max, row_sum = ctx.saved_tensors
        b, hq, lq, d = q.shape
        lk = k.shape[2]
        rows = q.transpose(1, 2).reshape(b * lq, hq, d)
        dq, dk, dv = attention_backward(rows, k, v, grad.transpose(1, 2).reshape(b * lq, hq, d),
                                        row_max.reshape(b * lq, hq), row_sum.reshape(b * lq, hq),
                                        [i * lq for i in range(b + 1)], [lk] * b, None, ctx.scale, False, None,
                                        mask=visible.reshape(b * lq, lk))
        return dq.view(b, lq, hq, d).transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


@register("native", "masked_attention")
def masked_attention(q, k, v, visible, scale):
    if q.dtype == torch.float64:
        return portable.masked_attention(q, k, v, visible, scale, kernels=cpu.KERNELS)
    return _MaskedAttention.apply(q, k, v, visible, scale)
