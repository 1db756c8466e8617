"""Invariance sweeps and accuracy for attention (docs/contract.md, section 2).

The reference layout is every sequence prefilled whole in one packed call. Each sweep computes the
same sequences another way and demands bitwise equal outputs (and, where a backward exists, equal
dq, dk, dv per sequence): alone, in another order, next to NaN/Inf sequences, with padding rows,
strided, on one thread, again; prefilled in chunks of 1, 7, 16 and 100 tokens; and decoded token by
token from a paged cache whose blocks are scattered and whose unwritten slots hold NaN, with
sequences arriving at different steps so that prefill chunks and decode tokens share calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import contract, ops
from ..backends import reference
from ..numerics.fixed_order import ceil_div
from ..paged_cache import build_step
from ..registry import use_backend
from .check import (
    AccuracyResult,
    OpReport,
    SweepResult,
    bitwise_diff,
    default_backend,
    max_abs_error,
    num_threads,
    threads_sweep,
)


@dataclass(frozen=True)
class AttnSizes:
    lens: tuple[int, ...] = (37, 130, 1, 200, 64)   # one token, an exact key block, several blocks
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    window: int | None = None
    block_size: int = 16                            # paged cache block size
    chunks: tuple[int, ...] = (1, 7, 16, 100)
    # Paged decode: the tokens each sequence decodes one at a time, after a prefill of the rest.
    # None decodes every token after the first chunk. A bound keeps a slow backend (Triton's
    # interpreter runs a launch per step) to a few steps; it should still take each sequence's
    # decoded tokens across a cache block and a key block.
    decode: int | None = None


@dataclass
class Seq:
    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor


def _cu(lengths: list[int]) -> Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64)


class AttnCase:
    """The sequences of a check, drawn on the CPU (the same values on any machine) and moved to `device`."""

    def __init__(self, dtype: torch.dtype, sizes: AttnSizes, seed: int, device: str | torch.device = "cpu"):
        self.dtype, self.sizes, self.device = dtype, sizes, torch.device(device)
        gen = torch.Generator().manual_seed(seed)

        def t(n: int, h: int) -> Tensor:
            return torch.randn(n, h, sizes.head_dim, generator=gen, dtype=torch.float64).to(dtype).to(self.device)

        self.seqs = [Seq(t(n, sizes.q_heads), t(n, sizes.kv_heads), t(n, sizes.kv_heads), t(n, sizes.q_heads))
                     for n in sizes.lens]
        self.garbage = []
        for n in (5, 70):
            g = Seq(t(n, sizes.q_heads), t(n, sizes.kv_heads), t(n, sizes.kv_heads), t(n, sizes.q_heads))
            for x in (g.q, g.k, g.v, g.do):
                x[0::3] = float("nan")
                x[1::3] = float("inf")
            self.garbage.append(g)

    def prefill(self, backend: str, order: list, grad: bool, pad_rows: int = 0, strided: bool = False):
        """One packed call over whole sequences (ints index self.seqs, Seq objects are extra)."""
        seqs = [self.seqs[i] if isinstance(i, int) else i for i in order]
        cu = _cu([s.q.shape[0] for s in seqs])
        q = torch.cat([s.q for s in seqs])
        k = torch.cat([s.k for s in seqs])
        v = torch.cat([s.v for s in seqs])
        do = torch.cat([s.do for s in seqs])
        if pad_rows:
            junk = torch.full((pad_rows,) + tuple(q.shape[1:]), float("nan"), dtype=q.dtype, device=q.device)
            q = torch.cat([q, junk])
            do = torch.cat([do, torch.zeros_like(junk)])
        if strided:
            q, k, v = (torch.stack([x, x], dim=-1)[..., 0] for x in (q, k, v))
        q, k, v = (x.detach().requires_grad_(grad) for x in (q, k, v))
        with use_backend(backend):
            out = ops.attention(q, k, v, cu, cu[: len(cu)] if not pad_rows else cu,
                                window=self.sizes.window)
            if grad:
                out.backward(do)
        per = []
        for b in range(len(seqs)):
            a, e = int(cu[b]), int(cu[b + 1])
            per.append((out[a:e].detach(),) + ((q.grad[a:e], k.grad[a:e], v.grad[a:e]) if grad else ()))
        return per, out.detach()[int(cu[-1]):]


def compare(name: str, ref: list[tuple], got: list[tuple], pairs: list[tuple[int, int]]) -> SweepResult:
    ok, worst, what, rows = True, 0.0, "", 0
    labels = ("output", "dq", "dk", "dv")
    for ri, gi in pairs:
        for label, a, b in zip(labels, got[gi], ref[ri]):
            eq, d = bitwise_diff(a, b)
            rows += a.shape[0] if label == "output" else 0
            if not eq:
                ok = False
                if d >= worst:
                    worst, what = d, f"{label} of sequence {ri}"
    if rows == 0:
        return SweepResult(name, False, math.inf, 0, "no rows compared")
    return SweepResult(name, ok, worst, rows, "" if ok else f"{what} differs")


def _chunked(case: AttnCase, backend: str, chunk: int) -> list[Tensor]:
    """Every sequence prefilled in chunks of `chunk` queries, all sequences advancing together."""
    n = len(case.seqs)
    outs: list[list[Tensor]] = [[] for _ in range(n)]
    done = [0] * n
    while any(done[i] < case.seqs[i].q.shape[0] for i in range(n)):
        qs, ks, vs, lq, lk, who = [], [], [], [], [], []
        for i, s in enumerate(case.seqs):
            total = s.q.shape[0]
            if done[i] >= total:
                continue
            end = min(total, done[i] + chunk)
            qs.append(s.q[done[i]:end])
            ks.append(s.k[:end])
            vs.append(s.v[:end])
            lq.append(end - done[i])
            lk.append(end)
            who.append(i)
            done[i] = end
        with use_backend(backend), torch.no_grad():
            out = ops.attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), _cu(lq), _cu(lk), window=case.sizes.window)
        cu = _cu(lq)
        for j, i in enumerate(who):
            outs[i].append(out[int(cu[j]):int(cu[j + 1])])
    return [torch.cat(o) for o in outs]


def paged_decode(case: AttnCase, backend: str, first_chunk: int = 5) -> list[Tensor]:
    """Sequence i arrives at step i with a prefill of `first_chunk` tokens (or of all but its last
    `AttnSizes.decode`, if more), then decodes one token a step from a paged cache with scattered
    blocks and NaN in every slot not yet written."""
    s = case.sizes
    n = len(case.seqs)
    blocks_needed = sum(ceil_div(x.q.shape[0], s.block_size) for x in case.seqs)
    num_blocks = blocks_needed + 3
    k_cache = torch.full((num_blocks, s.block_size, s.kv_heads, s.head_dim), float("nan"), dtype=case.dtype,
                         device=case.device)
    v_cache = torch.full_like(k_cache, float("nan"))
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist()
    blocks: list[list[int]] = [[] for _ in range(n)]
    done = [0] * n
    outs: list[list[Tensor]] = [[] for _ in range(n)]
    step = 0
    while any(done[i] < case.seqs[i].q.shape[0] for i in range(n)):
        who, spans, qs, new_k, new_v = [], [], [], [], []
        for i, seq in enumerate(case.seqs):
            total = seq.q.shape[0]
            if step < i or done[i] >= total:
                continue
            prefill = first_chunk if s.decode is None else max(first_chunk, total - s.decode)
            end = min(total, done[i] + (prefill if done[i] == 0 else 1))
            while len(blocks[i]) * s.block_size < end:
                blocks[i].append(free.pop())
            spans.append((blocks[i], done[i], end))
            new_k.append(seq.k[done[i]:end])
            new_v.append(seq.v[done[i]:end])
            qs.append(seq.q[done[i]:end])
            who.append(i)
            done[i] = end
        step += 1
        if not who:
            continue
        cache_step, _ = build_step(spans, s.block_size, case.device)
        ops.write_kv(torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, cache_step.slot_mapping)
        with use_backend(backend):
            out = ops.paged_attention(torch.cat(qs), k_cache, v_cache, cache_step.block_table, cache_step.seq_lens,
                                      cache_step.cu_seqlens_q, window=s.window)
        cu = cache_step.cu_seqlens_q
        for j, i in enumerate(who):
            outs[i].append(out[int(cu[j]):int(cu[j + 1])])
    return [torch.cat(o) for o in outs]


def _accuracy(case: AttnCase, ref: list[tuple], grad: bool) -> AccuracyResult:
    order = list(range(len(case.seqs)))
    cu = _cu([s.q.shape[0] for s in case.seqs])
    q, k, v = (torch.cat([getattr(s, n) for s in case.seqs]).double().requires_grad_(grad) for n in "qkv")
    out64 = reference.attention(q, k, v, cu, cu, window=case.sizes.window)
    if grad:
        out64.backward(torch.cat([s.do for s in case.seqs]).double())
    with num_threads(2):
        eager, _ = case.prefill("eager", order, grad)
    return score(case.dtype, ref, eager, out64, (q.grad, k.grad, v.grad) if grad else None)


def score(dtype: torch.dtype, ref: list[tuple], eager: list[tuple], out64: Tensor,
          grads64: tuple[Tensor, Tensor, Tensor] | None) -> AccuracyResult:
    """An attention op's accuracy against float64 (out64 and, when given, the float64 dq, dk, dv),
    each per-sequence tuple (out, dq, dk, dv) of `ref` (lockstep) and `eager` concatenated in order:
    the contract's tolerance and the relative criterion against eager PyTorch."""
    grad = grads64 is not None
    got_out = torch.cat([r[0] for r in ref])
    eager_out = torch.cat([r[0] for r in eager])
    tol = contract.tolerance("attention", dtype, "forward")
    fwd_err, eager_err = max_abs_error(got_out, out64), max_abs_error(eager_out, out64)
    rel = (got_out.double() - out64.detach()).abs() / out64.detach().abs().clamp_min(1e-30)
    factor, floor_ulps = contract.relative_to_pytorch()
    relative_ok = fwd_err <= factor * eager_err + floor_ulps * contract.ulp(dtype, float(out64.detach().abs().max()))
    g_err = g_excess = e_g = None
    if grad:
        gtol = contract.tolerance("attention", dtype, "gradient")
        g_err, g_excess, e_g = 0.0, -1.0, 0.0
        for idx, full in zip((1, 2, 3), grads64):
            got = torch.cat([r[idx] for r in ref])
            eg = torch.cat([r[idx] for r in eager])
            err = max_abs_error(got, full)
            g_err, e_g = max(g_err, err), max(e_g, max_abs_error(eg, full))
            g_excess = max(g_excess, gtol.excess(got, full))
            relative_ok = relative_ok and err <= factor * max_abs_error(eg, full) + floor_ulps * contract.ulp(
                dtype, float(full.abs().max()))
    passed = tol.excess(got_out, out64) <= 0 and (g_excess is None or g_excess <= 0) and relative_ok
    ratio = fwd_err / eager_err if eager_err > 0 else (0.0 if fwd_err == 0 else math.inf)
    return AccuracyResult(fwd_err, float(torch.nan_to_num(rel, nan=math.inf).max()), tol.excess(got_out, out64),
                          eager_err, g_err, g_excess, e_g, ratio, relative_ok, passed)


def check_attention(dtype: torch.dtype, backend: str | None = None, grad: bool = True, seed: int = 0,
                    sizes: AttnSizes | None = None, with_accuracy: bool = True, device: str = "cpu") -> OpReport:
    """Every attention sweep (and optionally the accuracy check) for one dtype, on `backend`
    (default: the one lockstep runs on `device`, `default_backend`), with inputs on `device`."""
    backend = backend or default_backend(device)
    sizes = sizes or AttnSizes()
    case = AttnCase(dtype, sizes, seed, device)
    n = len(case.seqs)
    order = list(range(n))
    sweeps = []
    with num_threads(2):
        ref, _ = case.prefill(backend, order, grad)
        for i in order:
            got, _ = case.prefill(backend, [i], grad)
            sweeps.append(compare(f"alone (sequence {i})", ref, got, [(i, 0)]))
        got, _ = case.prefill(backend, order[::-1], grad)
        sweeps.append(compare("reversed order", ref, got, [(i, n - 1 - i) for i in order]))
        odd, even = order[1::2], order[0::2]
        mixed = [case.garbage[0]] + odd + [case.garbage[1]] + even
        pairs = [(i, 1 + j) for j, i in enumerate(odd)] + [(i, 2 + len(odd) + j) for j, i in enumerate(even)]
        got, _ = case.prefill(backend, mixed, grad)
        sweeps.append(compare("next to NaN/Inf sequences", ref, got, pairs))
        got, pad_out = case.prefill(backend, order, grad, pad_rows=9)
        r = compare("padding rows", ref, got, [(i, i) for i in order])
        if not bool((pad_out == 0).all()):
            r.passed, r.detail = False, "padding rows' output is not zero"
        sweeps.append(r)
        got, _ = case.prefill(backend, order, grad, strided=True)
        sweeps.append(compare("strided", ref, got, [(i, i) for i in order]))
        got, _ = case.prefill(backend, order, grad)
        sweeps.append(compare("repeat (determinism)", ref, got, [(i, i) for i in order]))
        fwd_only = [(r[0],) for r in ref]
        for chunk in sizes.chunks:
            outs = _chunked(case, backend, chunk)
            sweeps.append(compare(f"chunked prefill {chunk}", fwd_only, [(o,) for o in outs], [(i, i) for i in order]))
        outs = paged_decode(case, backend)
        sweeps.append(compare("paged decode (staggered arrivals)", fwd_only, [(o,) for o in outs],
                               [(i, i) for i in order]))
    with num_threads(1):
        got, _ = case.prefill(backend, order, grad)
        sweeps.append(threads_sweep(backend, compare("threads=1 vs 2", ref, got, [(i, i) for i in order])))
    acc = _accuracy(case, ref, grad) if with_accuracy else None
    return OpReport("attention", backend, contract.dtype_name(dtype), acc, sweeps)
