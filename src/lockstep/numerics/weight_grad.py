"""The orders in which weight gradients reduce over rows: fixed blocks of `ROW_BLOCK` rows, each
block's contribution produced by a fixed-shape GEMM and added in block order; a pairwise fold of
32-row leaves where the sum must be as exact as the BLAS's own; and a unit tree's node in one call.
Zero rows appended at the end (padding) add exact zeros and change no bit. The losses' sums over
rows (`reduce_losses`) reduce in the same fixed blocks."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from .cpu_kernels import CpuKernels, kernels_for
from .tiles import ROW_BLOCK, accumulate_dtype
from .tree import tree_node_into

def sum_over_rows(rows: int, block_partial: Callable[[int, int], Tensor]) -> Tensor:
    """Sum of per-row contributions in the documented fixed order.

    block_partial(start, stop) returns the fixed-shape partial of rows [start, stop) of one block of
    ROW_BLOCK rows (the caller zero-pads the block). Partials are added in block order, starting
    from the first block. Returns the accumulated tensor (the caller's accumulation dtype).
    """
    total = None
    for start in range(0, max(rows, 1), ROW_BLOCK):
        part = block_partial(start, min(start + ROW_BLOCK, rows))
        total = part if total is None else total + part
    return total


def padded_block(x: Tensor, start: int, stop: int, rows: int = ROW_BLOCK) -> Tensor:
    """Rows [start, stop) of the second-to-last dimension (the first for 1-D/2-D tensors),
    zero-padded to `rows` rows (ROW_BLOCK by default)."""
    dim = 0 if x.dim() <= 2 else x.dim() - 2
    block = x.narrow(dim, start, stop - start)
    if stop - start == rows:
        return block
    shape = list(x.shape)
    shape[dim] = rows
    out = x.new_zeros(shape)
    out.narrow(dim, 0, stop - start).copy_(block)
    return out


def weight_grad(grad_out: Tensor, inp: Tensor, out: Tensor | None = None, *,
                kernels: CpuKernels | None = None) -> Tensor:
    """sum over rows r of grad_out[r]^T inp[r]: [M, N], [M, K] -> [N, K]; batched: [B, M, N],
    [B, M, K] -> [B, N, K]; in the accumulation dtype, into `out` when given. On the CPU kernels
    `kernels` where they take `grad_out`, else (and for None) by `torch_weight_grad`."""
    taken = kernels_for(kernels, grad_out, float64=True)
    if taken is not None:
        return taken.weight_grad(grad_out, inp, out)
    return torch_weight_grad(grad_out, inp, out)


def torch_weight_grad(grad_out: Tensor, inp: Tensor, out: Tensor | None = None,
                      rows_per_block: int = ROW_BLOCK) -> Tensor:
    """sum over rows r of grad_out[r]^T inp[r], in fixed row blocks: [M, N], [M, K] -> [N, K];
    batched: [B, M, N], [B, M, K] -> [B, N, K]. In the accumulation dtype; into `out` (a
    contiguous tensor of that shape and dtype, overwritten) when given.

    Block by block from row 0, one GEMM of fixed shape [N, R] @ [R, K], R = rows_per_block
    (ROW_BLOCK unless the caller fixes another): the first writes the accumulator
    (out <- G_0^T X_0), each next one adds into it in place (addmm with beta = 1:
    out <- out + G_b^T X_b). The last block is zero-padded, so zero-gradient rows appended
    to the batch add exact zeros. Writing the first block, rather than adding it to zeros, spares a
    pass over the accumulator (a vocabulary-sized one for the LM head).
    """
    acc = accumulate_dtype(grad_out.dtype)
    rows = grad_out.shape[-2]
    shape = tuple(grad_out.shape[:-2]) + (grad_out.shape[-1], inp.shape[-1])
    if out is None:
        out = grad_out.new_empty(shape, dtype=acc)
    elif out.shape != shape or out.dtype != acc or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {acc} tensor of shape {shape}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if rows == 0:
        return out.zero_()
    for start in range(0, rows, rows_per_block):
        stop = min(start + rows_per_block, rows)
        g = padded_block(grad_out, start, stop, rows_per_block).to(acc).transpose(-1, -2)
        x = padded_block(inp, start, stop, rows_per_block).to(acc)
        if start == 0:
            (torch.bmm if out.dim() == 3 else torch.mm)(g, x, out=out)
        elif out.dim() == 3:
            torch.baddbmm(out, g, x, out=out)
        else:
            torch.addmm(out, g, x, out=out)
    return out


# The LM head's weight-gradient blocks on PyTorch's GEMMs (docs/adr/0034): each block is one chain on
# MKL, so the block's length sets the error; 128-row blocks left it well past eager PyTorch's, 32-row
# blocks within it.
LM_HEAD_ROW_BLOCK = 32


def lm_head_weight_grad(grad_out: Tensor, inp: Tensor, out: Tensor | None = None, *,
                        kernels: CpuKernels | None = None) -> Tensor:
    """`weight_grad` of the LM head, grad_out [M, N] (the logits' gradient) and inp [M, K]: on the
    CPU kernels `kernels`, where they take grad_out, exactly `weight_grad`; on PyTorch's GEMMs,
    `torch_weight_grad`'s order in LM_HEAD_ROW_BLOCK-row blocks. Its sum over rows is one
    large-valued gradient (a target's column gathers a whole 1 per row that picks it), where each
    block's chain is most of the error."""
    if kernels_for(kernels, grad_out, float64=True) is not None:
        return weight_grad(grad_out, inp, out, kernels=kernels)
    return torch_weight_grad(grad_out, inp, out, rows_per_block=LM_HEAD_ROW_BLOCK)


# pairwise_weight_grad's leaf: the shortest chain whose cost stays near the blocked order's (16 rows
# are more exact still and cost markedly more; docs/adr/0033).
LEAF_ROWS = 32
# Leaves multiplied at a time. A power of two, so each chunk is a whole subtree of the pairwise fold
# and chunking changes no bit; it bounds the products held at once to 64 [N, K] per batch entry (all
# of them are 268 MB per query head of a KV group at 32k query rows, 8 KV heads and head dim 128).
CHUNK_LEAVES = 64


def pairwise_weight_grad(grad_out: Tensor, inp: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """sum over rows r of grad_out[b, r]^T inp[b, r]: [B, M, N], [B, M, K] -> [B, N, K], in the
    accumulation dtype, for sums over a few hundred rows that must be as exact as the BLAS's own.

    Each LEAF_ROWS rows (the last zero-padded) are one product, every leaf of one shape, batched
    into GEMMs CHUNK_LEAVES leaves at a time (on the CPU kernels `kernels` where they take them); the
    leaves are then added pairwise, neighbours first, an odd last one passed up a level. The order
    depends on M alone. weight_grad's 128-row blocks are each summed in one chain on some BLASes
    (MKL's GEMM at these shapes), which put attention's dk and dv, sums over queries, at several
    times eager PyTorch's error (docs/adr/0033)."""
    if grad_out.dim() != 3 or inp.dim() != 3:
        raise ValueError(f"grad_out, inp: expected 3-D tensors [B, M, N] and [B, M, K], got shapes "
                         f"{tuple(grad_out.shape)} and {tuple(inp.shape)}")
    if grad_out.shape[:2] != inp.shape[:2]:
        raise ValueError(f"inp: expected the batch and row counts of grad_out, {tuple(grad_out.shape[:2])}, "
                         f"got {tuple(inp.shape[:2])}")
    acc = accumulate_dtype(grad_out.dtype)
    b, m, n = grad_out.shape
    k = inp.shape[-1]
    leaves = max(1, -(-m // LEAF_ROWS))
    if leaves * LEAF_ROWS != m:
        grad_out = torch.cat([grad_out, grad_out.new_zeros(b, leaves * LEAF_ROWS - m, n)], 1)
        inp = torch.cat([inp, inp.new_zeros(b, leaves * LEAF_ROWS - m, k)], 1)
    g_leaves = grad_out.reshape(b, leaves, LEAF_ROWS, n)
    x_leaves = inp.reshape(b, leaves, LEAF_ROWS, k)
    taken = kernels_for(kernels, grad_out, float64=True)
    chunk_sums = []
    for start in range(0, leaves, CHUNK_LEAVES):
        count = min(CHUNK_LEAVES, leaves - start)
        g = g_leaves[:, start:start + count].reshape(b * count, LEAF_ROWS, n).to(acc).contiguous()
        x = x_leaves[:, start:start + count].reshape(b * count, LEAF_ROWS, k).to(acc).contiguous()
        # One fixed GEMM shape (LEAF_ROWS terms) for every leaf, so torch's needs no padding to ROW_BLOCK.
        part = taken.weight_grad(g, x) if taken is not None else torch.bmm(g.transpose(1, 2), x)
        chunk_sums.append(_pairwise_sum(part.view(b, count, n, k)))
    return _pairwise_sum(torch.stack(chunk_sums, 1))


def _pairwise_sum(part: Tensor) -> Tensor:
    """part[:, 0] + part[:, 1] + ... added pairwise, neighbours first, an odd last one passed up a
    level: [B, L, N, K] -> [B, N, K]."""
    while part.shape[1] > 1:
        pairs = part.shape[1] // 2
        merged = part[:, 0:2 * pairs:2] + part[:, 1:2 * pairs:2]
        part = merged if part.shape[1] % 2 == 0 else torch.cat([merged, part[:, -1:]], 1)
    return part[:, 0]


def weight_grad_node(grad_out: Tensor, inp: Tensor, bounds: list[int], out: Tensor, spare: list[Tensor],
                     leaf: Callable[..., Tensor] | None = None, *, kernels: CpuKernels | None = None) -> Tensor:
    """`out` = the canonical tree's node over the units whose rows of grad_out [M, N] and inp [M, K]
    are bounds[u] .. bounds[u + 1] (from 0 to M; a power of two of units), each unit's leaf its own
    `leaf(grad_out_rows, inp_rows, out=buffer)` (`weight_grad` on `kernels` by default; one whose
    bits on those kernels are weight_grad's, such as lm_head_weight_grad on them): what grad_tree's
    unit tree makes of the units' partials. out: the accumulation dtype, [N, K], contiguous. On the
    one-call form of the CPU kernels `kernels` where they have one, else by `tree_node_into` (whose
    buffers come from and go back to `spare`)."""
    leaf = leaf or functools.partial(weight_grad, kernels=kernels)
    if len(bounds) == 2:
        return leaf(grad_out, inp, out=out)
    taken = kernels_for(kernels, grad_out)
    if taken is not None and taken.weight_grad_node is not None and grad_out.dim() == 2:
        node = taken.weight_grad_node(grad_out, inp, bounds, out)
        if node is not None:
            return node
    return tree_node_into(out, len(bounds) - 1, spare, lambda i, buffer: leaf(
        grad_out[bounds[i]:bounds[i + 1]], inp[bounds[i]:bounds[i + 1]], out=buffer))


def column_sum(x: Tensor) -> Tensor:
    """sum over rows of x [M, N] -> [N] in the accumulation dtype, in fixed row blocks.

    Within a block the ROW_BLOCK rows are folded pairwise with elementwise adds (exact in every code
    path); blocks are added in order.
    """
    x = x.to(accumulate_dtype(x.dtype))

    def block(start: int, stop: int) -> Tensor:
        b = padded_block(x, start, stop)
        width = ROW_BLOCK
        while width > 1:
            width //= 2
            b = b[:width] + b[width:2 * width]
        return b[0]

    return sum_over_rows(x.shape[0], block)


def reduce_losses(loss: Tensor, count: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """Per-row losses [rows] (0 at ignored rows) -> cross_entropy's output: as they are ("none"),
    their fixed-order sum ("sum") or that sum over the non-ignored count ("mean"). Every backend's
    cross_entropy reduces through this, so the sum's order is the same on all of them."""
    if reduction == "none":
        return loss.to(dtype)
    total = column_sum(loss[:, None])[0]
    if reduction == "mean":
        total = total / count.to(total.dtype)
    return total.to(dtype)


def row_scale(grad: Tensor, reduction: str, count: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """d loss / d (row loss) for each row [rows]: grad itself ("none"), grad / count ("mean") or
    grad ("sum"); the backward of `reduce_losses`."""
    if reduction == "none":
        return grad.contiguous().to(dtype)
    if reduction == "mean":
        return (grad.to(dtype) / count.to(dtype)).expand(rows).contiguous()
    return grad.to(dtype).expand(rows).contiguous()
