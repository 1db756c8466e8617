"""Portable selected_logprobs: LM head + log p(target) over fixed vocabulary chunks.

Forward: for each chunk of VOCAB_CHUNK rows of the head (in vocabulary order), logits of the
chunk by the row-tiled GEMM, then an online log-sum-exp update per row. Backward takes each
chunk's logits again: kept from the forward where all of them fit in `keep_logits_bytes()`,
recomputed otherwise (the same bits: a row's logits do not depend on the rows beside it); d(hidden)
accumulates the chunks in vocabulary order, and each chunk's weight gradient reduces over rows in
32-row blocks (fixed_order.lm_head_weight_grad, docs/adr/0034), a unit tree's leaves each its
own. Memory is O(tokens x VOCAB_CHUNK) beyond the kept logits.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
from torch import Tensor

from ...numerics import grad_tree
from ...numerics.fixed_order import (accumulate_dtype, exp, log, lm_head_weight_grad, logit_grad, lse_fold,
                                     matmul_rows, row_max, row_sum, scaled_logits, weight_grad_node)
from ...numerics.cpu_kernels import CpuKernels, columns_at_any_width
from ...registry import register
from ...numerics.second_order import first_order_only
from ...numerics.softcap import softcap as capped

VOCAB_CHUNK = 4096
# Rows x vocabulary up to which online_lse folds all chunks at once (32 MiB of fp32 logits), and on
# the native kernels takes them from one GEMM (whole_logits).
BATCHED_LSE_ELEMENTS = 1 << 23
# A training forward keeps its logits for the backward up to this many bytes per call (1 GiB: 1,700
# tokens of a 151,936-token vocabulary in fp32), which spares the backward one of the LM head's
# three GEMMs (docs/adr/0028). LOCKSTEP_KEEP_LOGITS_BYTES overrides it; 0 always recomputes.
KEEP_LOGITS_BYTES = 1 << 30


def keep_logits_bytes() -> int:
    """How many bytes of logits a selected_logprobs forward may keep for its backward:
    LOCKSTEP_KEEP_LOGITS_BYTES where set, else KEEP_LOGITS_BYTES."""
    value = os.environ.get("LOCKSTEP_KEEP_LOGITS_BYTES")
    if value is None or value == "":
        return KEEP_LOGITS_BYTES
    try:
        limit = int(value)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"LOCKSTEP_KEEP_LOGITS_BYTES: expected a whole number of bytes (0 or more), got {value!r}")
    return limit


def _chunk_logits(hidden: Tensor, weight: Tensor, start: int, acc: torch.dtype, cap: float | None,
                  kernels: CpuKernels | None, stop: int | None = None) -> tuple[Tensor, Tensor | None]:
    """The logits of the head's rows [start, stop) (one chunk unless `stop` says otherwise) as the
    GEMM left them (hidden's dtype), or capped in the accumulation dtype; and the cap's slope (None
    without one). fixed_order.scaled_logits divides them by the temperature."""
    logits = matmul_rows(hidden, weight[start:start + VOCAB_CHUNK if stop is None else stop].t(), kernels=kernels)
    if cap is None:
        return logits, None
    return capped(logits.to(acc), cap, kernels=kernels)


def whole_logits(hidden: Tensor, weight: Tensor, cap: float | None, *,
                 kernels: CpuKernels | None = None) -> Tensor | None:
    """Every chunk's logits [T, V] (as `_chunk_logits` gives them) from one GEMM, for a few rows
    (decode) on kernels whose columns have the same bits at any width (fixed_order.
    columns_at_any_width): one call starts its threads once and streams the head without a stop,
    where a 151,936-token vocabulary took a call per chunk, 38 of them (bf16 vocab_logprobs on 2
    threads, 1 / 8 / 32 rows: 0.83 / 0.74 / 0.69 of the chunked time, its chunks folded in one call
    too). None where that does not hold. The GEMM and the cap on the CPU kernels `kernels`."""
    if hidden.shape[0] * weight.shape[0] > BATCHED_LSE_ELEMENTS or not columns_at_any_width(hidden, kernels=kernels):
        return None
    logits, _ = _chunk_logits(hidden, weight, 0, accumulate_dtype(hidden.dtype), cap, kernels, stop=weight.shape[0])
    return logits


def _select(logits: Tensor, targets: Tensor, start: int) -> tuple[Tensor, Tensor]:
    local = targets - start
    inside = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
    return inside, picked


def online_lse(hidden: Tensor, weight: Tensor, temperature: float,
               visit: Callable[[int, Tensor], None] | None = None, cap: float | None = None,
               logits: Tensor | None = None, *, kernels: CpuKernels | None = None) -> Tensor:
    """log-sum-exp [T] of cap(hidden @ weight.T) / temperature over the vocabulary, chunk by chunk in
    vocabulary order (accumulation dtype). visit(start, logits) sees each chunk's logits before the
    temperature (`_chunk_logits`). `logits`: `whole_logits(hidden, weight, cap)`, where the caller
    has them (with the same cap); else they are taken from it where it gives them, and chunk by
    chunk otherwise.

    The fold over chunks (fixed_order.lse_fold): m_i = max(m_{i-1}, max of chunk i), s_i = s_{i-1}
    exp(m_{i-1} - m_i) + row_sum(exp(chunk_i - m_i)). A few rows at a time (decode) on PyTorch's
    kernels evaluate each step's elementwise and row_sum parts for all chunks at once and only the
    recurrence on s one chunk at a time: the same operations on the same values, so the same bits,
    in far fewer calls. On lockstep's own kernels a few rows' logits come from one GEMM
    (`whole_logits`) and are folded chunk after chunk in one call (their lse_fold's width). The GEMMs,
    exp, log and sums run on the CPU kernels `kernels` (None: PyTorch's)."""
    if logits is None:
        logits = whole_logits(hidden, weight, cap, kernels=kernels)
    if logits is not None:
        if visit is not None:
            for start in range(0, weight.shape[0], VOCAB_CHUNK):
                visit(start, logits[:, start:start + VOCAB_CHUNK])
        run_max, run_sum = lse_fold(logits, temperature, None, width=VOCAB_CHUNK, kernels=kernels)
        return run_max + log(run_sum, kernels=kernels)
    acc = accumulate_dtype(hidden.dtype)
    batched = hidden.shape[0] * weight.shape[0] <= BATCHED_LSE_ELEMENTS
    chunks, run = [], None
    for start in range(0, weight.shape[0], VOCAB_CHUNK):
        chunk, _ = _chunk_logits(hidden, weight, start, acc, cap, kernels)
        if visit is not None:
            visit(start, chunk)
        if batched:
            chunks.append(scaled_logits(chunk, temperature))
        else:
            run = lse_fold(chunk, temperature, run, kernels=kernels)
    if batched:
        return _lse_of_chunks(chunks, kernels)
    run_max, run_sum = run
    return run_max + log(run_sum, kernels=kernels)


def _lse_of_chunks(chunks: list[Tensor], kernels: CpuKernels | None) -> Tensor:
    """online_lse's fold over chunk logits [T, VOCAB_CHUNK] (the last may be shorter), batched."""
    full = [c for c in chunks if c.shape[1] == VOCAB_CHUNK]
    tail = chunks[len(full):]
    maxes = torch.stack([row_max(c) for c in chunks], dim=1)                 # [T, chunks]
    running = torch.cummax(maxes, dim=1).values                             # m_i: exact, as the loop's maximum
    sums = []
    if full:
        stacked = torch.stack(full, dim=1)                                  # [T, full chunks, VOCAB_CHUNK]
        sums.append(row_sum(exp(stacked - running[:, :len(full), None], kernels=kernels), kernels=kernels))
    if tail:
        sums.append(row_sum(exp(tail[0] - running[:, len(full), None], kernels=kernels), kernels=kernels)[:, None])
    chunk_sums = torch.cat(sums, dim=1)
    decay = exp(running[:, :-1] - running[:, 1:], kernels=kernels)
    run_sum = chunk_sums[:, 0]
    for i in range(1, chunk_sums.shape[1]):
        run_sum = run_sum * decay[:, i - 1] + chunk_sums[:, i]
    return running[:, -1] + log(run_sum, kernels=kernels)


def selected_logprobs_forward(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                              cap: float | None = None, keep: list[Tensor] | None = None, *,
                              kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    """Returns (log p(target) [T], log-sum-exp [T]), both in the accumulation dtype, on the CPU
    kernels `kernels` (None: PyTorch's). `keep`, when given, receives each chunk's logits [T, <=
    VOCAB_CHUNK] as `_chunk_logits` gives them (capped where `cap` is given), in vocabulary order."""
    target_logit = torch.zeros(hidden.shape[0], dtype=accumulate_dtype(hidden.dtype), device=hidden.device)

    def pick(start: int, logits: Tensor) -> None:
        nonlocal target_logit
        if keep is not None:
            keep.append(logits)
        inside, picked = _select(logits, targets, start)
        target_logit = torch.where(inside, scaled_logits(picked[:, None], temperature)[:, 0], target_logit)

    lse = online_lse(hidden, weight, temperature, pick, cap, kernels=kernels)
    return target_logit - lse, lse


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, cap: float | None,
                keeps: bool, kernels: CpuKernels | None) -> Tensor:
        kept = [] if keeps else None
        out, lse = selected_logprobs_forward(hidden, weight, targets, temperature, cap, kept, kernels=kernels)
        # Saved as tensors, so that saved-tensor hooks (offloading, checkpointing) see them and
        # autograd frees them with the graph.
        ctx.save_for_backward(hidden, weight, targets, lse, *(kept or []))
        ctx.temperature, ctx.cap, ctx.kernels = temperature, cap, kernels
        ctx.use = grad_tree.capture("selected_logprobs", weight, hidden.shape[0], ctx.needs_input_grad[1])
        return out    # float32, or float64 for float64 inputs

    @staticmethod
    @first_order_only("selected_logprobs")
    def backward(ctx, grad_out: Tensor):
        hidden, weight, targets, lse, *kept = ctx.saved_tensors
        kernels = ctx.kernels
        acc = lse.dtype
        g = grad_out.contiguous().to(acc)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        # bf16 multiplies the logits' gradient rounded to bf16, in both GEMMs, as the forward and
        # stock PyTorch do (docs/adr/0020); other dtypes in the accumulation dtype, so that small
        # probabilities do not underflow in fp16.
        gemm = torch.bfloat16 if hidden.dtype == torch.bfloat16 else acc
        # The weight gradients reduce over rows, which the GEMMs want contiguous: one column-major
        # copy of hidden here rather than a transposed copy for every vocabulary chunk.
        hidden_w = hidden.to(gemm).t().contiguous().t() if need_w else None

        def piece_backward(bounds: list[int]) -> Tensor | None:
            """d(hidden) of rows [bounds[0], bounds[-1]) into dh, and the weight gradient of the
            units with those row bounds: their canonical tree node (grad_tree.per_piece), formed
            chunk by chunk, or None."""
            first, stop = bounds[0], bounds[-1]
            h = hidden[first:stop]
            # Outside a unit tree the one partial is the gradient itself: each chunk's sum is
            # rounded to the weight's dtype as it is made (the bits of rounding the whole at the
            # end), so no vocabulary-sized fp32 tensor is written and converted. Every chunk written.
            rounded = ctx.use is None and weight.dtype != acc
            dw = (grad_tree.empty(ctx.use, weight.shape, weight.dtype if rounded else acc, weight.device)
                  if need_w else None)
            spare: list[Tensor] = []
            scale = g[first:stop] / ctx.temperature
            for chunk, start in enumerate(range(0, weight.shape[0], VOCAB_CHUNK)):
                if kept:
                    logits, slope = kept[chunk][first:stop], None
                else:
                    logits, slope = _chunk_logits(h, weight, start, acc, ctx.cap, kernels)
                # d log p(t) / d logit_j = [j == t] - p_j
                inside, _ = _select(logits, targets[first:stop], start)
                local = (targets[first:stop] - start).clamp(0, logits.shape[1] - 1)
                dlogits = logit_grad(logits, ctx.temperature, lse[first:stop], local, inside.to(acc), scale,
                                     gemm if slope is None else acc, kernels=kernels)
                if slope is not None:
                    dlogits = (dlogits * slope).to(gemm)
                stop_v = start + logits.shape[1]
                if need_h:
                    dh[first:stop].add_(matmul_rows(dlogits, weight[start:stop_v].to(gemm), kernels=kernels))
                if need_w and rounded:
                    dw[start:stop_v] = lm_head_weight_grad(dlogits, hidden_w[first:stop], kernels=kernels)
                elif need_w:
                    weight_grad_node(dlogits, hidden_w[first:stop], [b - first for b in bounds], dw[start:stop_v],
                                     spare, leaf=functools.partial(lm_head_weight_grad, kernels=kernels),
                                     kernels=kernels)
            return dw

        # A piece of units at a time inside a unit tree: its logits and d(hidden) over all its rows,
        # its units' weight gradients combined chunk by chunk, one vocabulary-sized tensor per piece.
        dw = grad_tree.per_piece(ctx.use, hidden.shape[0], piece_backward)
        return ((dh.to(hidden.dtype) if need_h else None), (None if dw is None else dw.to(weight.dtype)),
                None, None, None, None, None)


@register("portable", "selected_logprobs")
def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                      softcap: float | None = None, *, kernels: CpuKernels | None = None) -> Tensor:
    """The portable selected_logprobs, its GEMMs, exp, log and sums on the CPU kernels `kernels`
    (None: PyTorch's)."""
    return _SelectedLogprobs.apply(hidden.contiguous(), weight, targets, temperature, softcap,
                                   keeps_logits(hidden, weight, softcap), kernels)


def keeps_logits(hidden: Tensor, weight: Tensor, softcap: float | None) -> bool:
    """Whether the forward keeps its logits for the backward (docs/adr/0028): a backward will be
    asked for (gradients on, hidden or weight requiring one), on a CPU (elsewhere memory is the
    scarce side), without a cap (its slope is not kept), and tokens x vocabulary x the element size
    within keep_logits_bytes()."""
    limit = keep_logits_bytes()     # a bad setting is refused whether or not it would apply
    return (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
            and hidden.device.type == "cpu" and softcap is None
            and hidden.shape[0] * weight.shape[0] * hidden.element_size() <= limit)
