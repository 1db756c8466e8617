"""Portable masked attention: each query's keys re-anchored at the first key it can see, then the
attention op's per-sequence forward and backward (fixed 64-key blocks from the anchor), so its
output does not depend on padding or on what else is in the batch (docs/adr/0015)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...numerics.fixed_order import accumulate_dtype, log
from ...numerics.cpu_kernels import CpuKernels
from ...registry import register
from ...numerics.second_order import first_order_only
from . import attention as portable_attention


def anchor_groups(visible: Tensor) -> list[tuple[int, Tensor]]:
    """For one batch entry's [Lq, Lk] mask: (anchor key, query rows) for each distinct first visible
    key. Rows that see no key form no group (their output is zero)."""
    seen = visible.any(dim=1)
    first = visible.int().argmax(dim=1)
    groups = []
    for a in torch.unique(first[seen]).tolist():
        groups.append((a, torch.nonzero(seen & (first == a))[:, 0]))
    return groups


def forward(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, *,
            kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Lq, D] in q's dtype, logsumexp [B, Hq, Lq] float32). Queries that share an
    anchor run together, on the CPU kernels `kernels` (None: PyTorch's)."""
    acc = accumulate_dtype(q.dtype)
    b, hq, lq, _ = q.shape
    hkv = k.shape[1]
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((b, hq, lq), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(b):
        for a, rows in anchor_groups(visible[i]):
            qi = q[i][:, rows].transpose(0, 1).to(acc)
            ki, vi = k[i, :, a:].transpose(0, 1).to(acc), v[i, :, a:].transpose(0, 1).to(acc)
            o, st = portable_attention.group_forward(qi[None], ki[None], vi[None], [ki.shape[0]], scale, False, None,
                                                     visible[i][rows, a:][None], kernels=kernels)
            out[i][:, rows] = o[0].transpose(0, 1)
            g = st[0] + log(st[1], kernels=kernels)
            g = g.reshape(hkv, len(rows), hq // hkv).permute(0, 2, 1).reshape(hq, len(rows))
            lse[i][:, rows] = g.to(torch.float32)
    return out.to(q.dtype), lse


def backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, *,
             kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the forward's out; each anchor group's softmax statistics are recomputed by
    `forward`'s arithmetic, on the same `kernels`."""
    acc = accumulate_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    for i in range(q.shape[0]):
        for a, rows in anchor_groups(visible[i]):
            qi = q[i][:, rows].transpose(0, 1).to(acc)
            ki, vi = k[i, :, a:].transpose(0, 1).to(acc), v[i, :, a:].transpose(0, 1).to(acc)
            m = visible[i][rows, a:]
            _, stats = portable_attention.group_forward(qi[None], ki[None], vi[None], [ki.shape[0]], scale, False,
                                                        None, m[None], kernels=kernels)
            gq, gk, gv = portable_attention.sequence_backward(qi, ki, vi, grad_out[i][:, rows].transpose(0, 1).to(acc),
                                                              stats, scale, False, None, m, kernels=kernels)
            dq[i][:, rows] = gq.transpose(0, 1)
            dk[i, :, a:] += gk.transpose(0, 1)       # anchor groups in increasing order: a fixed order
            dv[i, :, a:] += gv.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kernels):
        ctx.save_for_backward(q, k, v, visible)
        ctx.scale, ctx.kernels = scale, kernels
        out, lse = forward(q, k, v, visible, scale, kernels=kernels)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @first_order_only("masked_attention")
    def backward(ctx, grad, _grad_lse):
        q, k, v, visible = ctx.saved_tensors
        return (*backward(grad, q, k, v, visible, ctx.scale, kernels=ctx.kernels), None, None, None)


@register("portable", "masked_attention")
def masked_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, *,
                     kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    """The portable masked attention, its GEMMs, exp and sums on the CPU kernels `kernels` (None: PyTorch's)."""
    return _MaskedAttention.apply(q, k, v, visible, scale, kernels)
