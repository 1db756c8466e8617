"""Reductions along a row: the fixed-order row sum, the row max, log_softmax's rows and the LM
head's per-chunk rows (the online log-sum-exp and the logits' gradient). Each row's bits depend on
its length alone. Each function takes the CPU kernels its exp, log and fused forms run on
(`kernels`, None for PyTorch's)."""

from __future__ import annotations

import torch
from torch import Tensor

from .cpu_kernels import CpuKernels, kernels_for
from .elementwise import exp, log
from .tiles import SUM_WIDTH, accumulate_dtype, ceil_div

def row_sum(x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """Sum over the last dimension in a fixed order that depends only on its length.

    x: [..., L] float tensor (any layout). Returns [...] of x's dtype.

    The row is cut into consecutive chunks of SUM_WIDTH lanes (the last one zero-padded); the chunks
    are added lane by lane in order, then the SUM_WIDTH lanes are folded pairwise (lane i with lane
    i + w/2). Only elementwise adds are used, and an elementwise add is exact IEEE arithmetic in the
    vectorised and the scalar loop alike, so no thread split or tail handling can change a bit.
    The fused form of `kernels` runs it where they have one (the same bits).
    """
    length = x.shape[-1]
    if length == 0:
        return x.new_zeros(x.shape[:-1])
    taken = kernels_for(kernels, x)
    if taken is not None and taken.row_sum is not None and x.dtype == torch.float32:
        return taken.row_sum(x.reshape(-1, length)).reshape(x.shape[:-1])
    width = SUM_WIDTH if length >= SUM_WIDTH else 1 << (length - 1).bit_length()
    padded = ceil_div(length, width) * width
    if padded != length:
        x = torch.nn.functional.pad(x, (0, padded - length))
    acc = x[..., 0:width]
    for start in range(width, padded, width):
        acc = acc + x[..., start:start + width]
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:2 * width]
    return acc[..., 0]


def row_max(x: Tensor) -> Tensor:
    """Max over the last dimension. Max is exact in any order, so torch's own kernel is invariant.

    NaN propagates (torch.amax returns NaN for a row holding one)."""
    return torch.amax(x, dim=-1)


def shifted_and_lse(x: Tensor, *, kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    """For rows x [M, V] (accumulation dtype): (x - exact row max, log row_sum(exp(x - max))) per row."""
    shifted = x - row_max(x)[:, None]
    return shifted, log(row_sum(exp(shifted, kernels=kernels), kernels=kernels), kernels=kernels)


def log_softmax_rows(x: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """log_softmax of each row of x [M, V] (accumulation dtype): shifted = x - (exact row max), then
    shifted - log(row_sum(exp(shifted))). On the fused form of `kernels` where they have one (the
    same bits; one pass over memory instead of several)."""
    taken = kernels_for(kernels, x)
    if taken is not None and taken.log_softmax is not None and x.dtype == torch.float32:
        return taken.log_softmax(x)
    shifted, lse = shifted_and_lse(x, kernels=kernels)
    return shifted - lse[:, None]


def log_softmax_rows_backward(g: Tensor, y: Tensor, *, kernels: CpuKernels | None = None) -> Tensor:
    """The gradient of `log_softmax_rows` from its output y and the output's gradient g (both [M, V],
    accumulation dtype): g - exp(y) * row_sum(g). On the fused form of `kernels` where they have one."""
    taken = kernels_for(kernels, g)
    if taken is not None and taken.log_softmax_backward is not None and g.dtype == torch.float32:
        return taken.log_softmax_backward(g, y)
    return g - exp(y, kernels=kernels) * row_sum(g, kernels=kernels)[:, None]


def scaled_logits(chunk: Tensor, temperature: float) -> Tensor:
    """A chunk of logits [T, L] (the LM head GEMM's dtype) in the accumulation dtype, divided by the
    temperature (not at 1)."""
    x = chunk.to(accumulate_dtype(chunk.dtype))
    return x if temperature == 1.0 else x / temperature


def lse_fold(chunk: Tensor, temperature: float, run: tuple[Tensor, Tensor] | None,
             width: int | None = None, *, kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    """One step of the LM head's online log-sum-exp over vocabulary chunks. chunk: logits [T, L] in
    the GEMM's dtype, scaled here (`scaled_logits`); run: (running max, running sum) [T] in the
    accumulation dtype, None at the first chunk. Returns the new (max, sum):

        m = max(run max, row_max(x)); s = run sum * exp(run max - m) + row_sum(exp(x - m)),

    at the first chunk m = row_max(x) and s = row_sum(exp(x - m)). width: take `chunk` as several
    chunks, its consecutive pieces of `width` columns (the last may be shorter), folded one after
    another. On the fused form of `kernels` where they have one (the same bits, one pass over the
    logits, one call for all the pieces)."""
    if width is not None and width < 1:
        raise ValueError(f"width: expected a positive number of columns, got {width}")
    taken = kernels_for(kernels, chunk)
    if taken is not None and taken.lse_fold is not None and chunk.dim() == 2:
        return taken.lse_fold(chunk, temperature, run, width)
    if width is not None and width < chunk.shape[-1]:
        for start in range(0, chunk.shape[-1], width):
            run = lse_fold(chunk[..., start:start + width], temperature, run, kernels=kernels)
        return run
    x = scaled_logits(chunk, temperature)
    chunk_max = row_max(x)
    if run is None:
        return chunk_max, row_sum(exp(x - chunk_max[:, None], kernels=kernels), kernels=kernels)
    run_max, run_sum = run
    new_max = torch.maximum(run_max, chunk_max)
    return new_max, (run_sum * exp(run_max - new_max, kernels=kernels)
                     + row_sum(exp(x - new_max[:, None], kernels=kernels), kernels=kernels))


def logit_grad(chunk: Tensor, temperature: float, lse: Tensor, local: Tensor, inside: Tensor, scale: Tensor,
               out_dtype: torch.dtype, *, kernels: CpuKernels | None = None) -> Tensor:
    """The gradient of scale * log p(target) with respect to a chunk's scaled logits x
    (`scaled_logits` of chunk [T, L], the GEMM's dtype): d = -exp(x - lse), plus `inside` at column
    `local`, times scale; in out_dtype. lse, inside (1 where the row's target lies in the chunk,
    else 0) and scale: [T], accumulation dtype; local: [T] int64 in [0, L). On the fused form of
    `kernels` where they have one (the same bits)."""
    taken = kernels_for(kernels, chunk)
    if (taken is not None and taken.logit_grad is not None and chunk.dim() == 2
            and out_dtype in (torch.float32, torch.bfloat16)):
        return taken.logit_grad(chunk, temperature, lse, local, inside, scale, out_dtype)
    d = -exp(scaled_logits(chunk, temperature) - lse[:, None], kernels=kernels)
    d.scatter_(1, local[:, None], d.gather(1, local[:, None]) + inside[:, None])
    return (d * scale[:, None]).to(out_dtype)
