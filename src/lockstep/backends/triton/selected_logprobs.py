"""Triton selected_logprobs: the LM head in fixed vocabulary chunks (never the full logits).

Per chunk of VOCAB_CHUNK vocabulary rows, in vocabulary order: the chunk's logits by the GEMM
kernel, then `lse_update_kernel` folds them into each row's running log-sum-exp. Backward
recomputes each chunk's logits; d(hidden) accumulates the chunks in vocabulary order and each
chunk's dW reduces over rows inside the GEMM in fixed row steps. No atomics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics import grad_tree
from ...numerics.fixed_order import accumulate_dtype
from ...registry import register
from ...numerics.second_order import first_order_only
from ...numerics.softcap import softcap as capped
from .common import INTERPRET, cast_out, lane_block, row_lse
from .gemm import gemm, weight_grad

# Vocabulary rows per chunk. Under the interpreter (the CPU stand-in) chunks are smaller: the same
# kernels and chunk boundaries, at a size the interpreter runs in seconds rather than minutes.
VOCAB_CHUNK = 128 if INTERPRET else 4096


@triton.jit(do_not_specialize=["V", "start", "scale"])
def lse_update_kernel(logits_ptr, t_ptr, max_ptr, sum_ptr, tgt_ptr, V, start, scale, FIRST: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program r: fold one vocabulary chunk of row r's logits into its running max and sum, and pick
    the target's logit if the target falls in the chunk."""
    row = tl.program_id(0)
    lse = row_lse(logits_ptr + row * V, V, scale, BLOCK)        # the chunk's own log-sum-exp
    t = tl.load(t_ptr + row) - start
    inside = (t >= 0) & (t < V)
    picked = tl.load(logits_ptr + row * V + tl.where(inside, t, 0)).to(tl.float32) * scale
    if FIRST:
        tl.store(max_ptr + row, lse)
        tl.store(sum_ptr + row, 1.0)
        tl.store(tgt_ptr + row, tl.where(inside, picked, 0.0))
    else:
        m = tl.load(max_ptr + row)
        s = tl.load(sum_ptr + row)
        new = tl.maximum(m, lse)
        tl.store(sum_ptr + row, s * tl.exp(m - new) + tl.exp(lse - new))
        tl.store(max_ptr + row, new)
        old = tl.load(tgt_ptr + row)
        tl.store(tgt_ptr + row, tl.where(inside, picked, old))


@triton.jit(do_not_specialize=["V", "start", "scale"])
def dlogits_kernel(logits_ptr, t_ptr, lse_ptr, g_ptr, out_ptr, V, start, scale, BLOCK: tl.constexpr):
    """Program r: d lp[r] / d logits of one chunk = g[r] * scale * ([j == t] - p_j)."""
    row = tl.program_id(0)
    t = tl.load(t_ptr + row) - start
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row) * scale
    lanes = tl.arange(0, BLOCK)
    for v0 in range(0, V, BLOCK):
        cols = v0 + lanes
        m = cols < V
        x = tl.load(logits_ptr + row * V + cols, mask=m, other=0.0).to(tl.float32) * scale
        d = (tl.where(cols == t, 1.0, 0.0) - tl.exp(x - lse)) * g
        tl.store(out_ptr + row * V + cols, cast_out(d, out_ptr), mask=m)


def _chunks(v: int):
    return [(s, min(v, s + VOCAB_CHUNK)) for s in range(0, v, VOCAB_CHUNK)]


def online_lse(hidden, weight, targets, temperature, visit=None, cap=None):
    """(target logit [T], log-sum-exp [T]) of cap(hidden @ weight.T) / temperature, chunk by chunk in
    vocabulary order; visit(start, logits) sees each chunk's capped, unscaled fp32 logits."""
    m = hidden.shape[0]
    acc = accumulate_dtype(hidden.dtype)
    run_max = torch.empty(m, dtype=acc, device=hidden.device)
    run_sum = torch.empty_like(run_max)
    tgt = torch.empty_like(run_max)
    for i, (s, e) in enumerate(_chunks(weight.shape[0])):
        logits = gemm(hidden, weight[s:e].t(), out_dtype=acc)
        if cap is not None:
            logits, _ = capped(logits, cap)
        if visit is not None:
            visit(s, logits)
        if m:
            lse_update_kernel[(m,)](logits, targets, run_max, run_sum, tgt, e - s, s, 1.0 / temperature,
                                    FIRST=i == 0, BLOCK=lane_block(e - s))
    return tgt, run_max + torch.log(run_sum)


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, cap):
        tgt, lse = online_lse(hidden, weight, targets, temperature, cap=cap)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.cap = temperature, cap
        ctx.use = grad_tree.capture("selected_logprobs", weight, hidden.shape[0], ctx.needs_input_grad[1])
        return tgt - lse

    @staticmethod
    @first_order_only("selected_logprobs")
    def backward(ctx, g):
        hidden, weight, targets, lse = ctx.saved_tensors
        acc = lse.dtype
        g = g.contiguous().to(acc)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        scale = 1.0 / ctx.temperature
        # bf16 multiplies the logits' gradient rounded to bf16, in both GEMMs, as the forward and
        # stock PyTorch do (docs/adr/0020); other dtypes in fp32, so that small probabilities do not
        # underflow in fp16.
        gemm_dtype = torch.bfloat16 if hidden.dtype == torch.bfloat16 else acc

        def rows_backward(first, stop):
            """d(hidden) of rows [first, stop) into dh, and their weight gradient (or None)."""
            m = stop - first
            h = hidden[first:stop]
            # every chunk written
            dw = grad_tree.empty(ctx.use, weight.shape, acc, weight.device) if need_w else None
            for s, e in _chunks(weight.shape[0]):
                logits = gemm(h, weight[s:e].t(), out_dtype=acc)
                slope = None
                if ctx.cap is not None:
                    logits, slope = capped(logits, ctx.cap)
                dl = torch.empty_like(logits)
                if m:
                    dlogits_kernel[(m,)](logits, targets[first:stop], lse[first:stop], g[first:stop], dl, e - s, s,
                                         scale, BLOCK=lane_block(e - s))
                if slope is not None:
                    dl = dl * slope
                dl = dl.to(gemm_dtype)
                if need_h:
                    gemm(dl, weight[s:e].to(gemm_dtype), out=dh[first:stop], accumulate=True)
                if need_w:
                    dw[s:e] = weight_grad(dl, h.to(gemm_dtype))
            return dw

        # Unit by unit inside a unit tree, so that one vocabulary-sized partial is held at a time.
        dw = grad_tree.per_unit(ctx.use, hidden.shape[0], rows_backward)
        return (dh.to(hidden.dtype) if need_h else None), (None if dw is None else dw.to(weight.dtype)), None, None, None


@register("triton", "selected_logprobs")
def selected_logprobs(hidden, weight, targets, temperature, softcap=None):
    return _SelectedLogprobs.apply(hidden.contiguous(), weight.contiguous(), targets.contiguous(), temperature, softcap)
