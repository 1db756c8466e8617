"""Invariance sweeps and accuracy for masked_attention (docs/contract.md, section 2).

The reference layout is a batch of causal sequences of different lengths, right-padded to one
length with random values in the padding. Each sweep computes the same sequences another way and
demands bitwise equal outputs and dq, dk, dv on their real tokens: alone, left-padded, with more
padding, in reversed order, next to a sequence of NaN and Inf, again, on one thread; and each
sequence's last token decoded alone against its keys (forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import contract, ops
from ..backends import reference
from ..registry import use_backend
from .attention_check import compare, score
from .check import AccuracyResult, OpReport, default_backend, num_threads, threads_sweep


@dataclass(frozen=True)
class MaskedSizes:
    lens: tuple[int, ...] = (37, 1, 70, 64)   # one token, an exact key block, several blocks
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32


class MaskedCase:
    """The sequences of a check ([heads, length, head_dim] each), drawn on the CPU and moved to `device`."""

    def __init__(self, dtype: torch.dtype, sizes: MaskedSizes, seed: int, device: str | torch.device = "cpu"):
        self.dtype, self.sizes, self.device = dtype, sizes, torch.device(device)
        self.gen = torch.Generator().manual_seed(seed)
        self.seqs = [tuple(self._randn(h, n) for h in (sizes.q_heads, sizes.kv_heads, sizes.kv_heads, sizes.q_heads))
                     for n in sizes.lens]

    def _randn(self, heads: int, n: int) -> Tensor:
        x = torch.randn(heads, n, self.sizes.head_dim, generator=self.gen, dtype=torch.float64)
        return x.to(self.dtype).to(self.device)

    def run(self, backend: str, order: list[int], grad: bool, pad: int = 3, left: bool = False,
            garbage: bool = False) -> list[tuple]:
        """One batched call; per sequence (out, dq, dk, dv) on its real tokens, as [length, heads, D]."""
        seqs = [self.seqs[i] for i in order]
        length = max(s[0].shape[1] for s in seqs) + pad
        batch = len(seqs) + garbage
        q, k, v, do = (self._randn(h, length)[None].repeat(batch, 1, 1, 1) for h in
                       (self.sizes.q_heads, self.sizes.kv_heads, self.sizes.kv_heads, self.sizes.q_heads))
        do.zero_()
        visible = torch.zeros(batch, length, length, dtype=torch.bool, device=self.device)
        spans = []
        for b, s in enumerate(seqs):
            n = s[0].shape[1]
            start = length - n if left else 0
            for t, part in zip((q, k, v, do), s):
                t[b, :, start:start + n] = part
            visible[b, start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
            spans.append((start, start + n))
        if garbage:                                   # a whole causal entry of NaN and Inf
            for t in (q, k, v):
                t[-1, :, 0::3] = float("nan")
                t[-1, :, 1::3] = float("inf")
            visible[-1] = torch.ones(length, length, dtype=torch.bool).tril()
        q, k, v = (x.requires_grad_(grad) for x in (q, k, v))
        with use_backend(backend):
            out, _ = ops.masked_attention(q, k, v, visible)
            if grad:
                out.backward(do)
        per = []
        for b, (a, e) in enumerate(spans):
            parts = [out.detach()] + ([q.grad, k.grad, v.grad] if grad else [])
            per.append(tuple(t[b, :, a:e].transpose(0, 1) for t in parts))
        return per

    def decode(self, backend: str) -> list[tuple]:
        """Each sequence's last query alone against all of its keys: (output row,)."""
        outs = []
        with use_backend(backend):
            for q, k, v, _ in self.seqs:
                visible = torch.ones(1, 1, k.shape[1], dtype=torch.bool, device=self.device)
                out, _ = ops.masked_attention(q[None, :, -1:], k[None], v[None], visible)
                outs.append((out[0].transpose(0, 1),))
        return outs


def _accuracy(case: MaskedCase, ref: list[tuple], grad: bool) -> AccuracyResult:
    outs, grads = [], [[], [], []]
    for q, k, v, do in case.seqs:
        q64, k64, v64 = (x.double().requires_grad_(grad) for x in (q, k, v))
        n = q.shape[1]
        visible = torch.ones(1, n, n, dtype=torch.bool, device=q.device).tril()
        out, _ = reference.masked_attention(q64[None], k64[None], v64[None], visible)
        if grad:
            out.backward(do.double()[None])
            for g, x in zip(grads, (q64, k64, v64)):
                g.append(x.grad.transpose(0, 1))
        outs.append(out.detach()[0].transpose(0, 1))
    with num_threads(2):
        eager = case.run("eager", list(range(len(case.seqs))), grad)
    return score(case.dtype, ref, eager, torch.cat(outs), tuple(torch.cat(g) for g in grads) if grad else None)


def check_masked_attention(dtype: torch.dtype, backend: str | None = None, grad: bool = True, seed: int = 0,
                           sizes: MaskedSizes | None = None, with_accuracy: bool = True,
                           device: str = "cpu") -> OpReport:
    """Every masked_attention sweep (and optionally the accuracy check) for one dtype, on `backend`
    (default: the one lockstep runs on `device`), with inputs on `device`."""
    backend = backend or default_backend(device)
    case = MaskedCase(dtype, sizes or MaskedSizes(), seed, device)
    n = len(case.seqs)
    order = list(range(n))
    same = [(i, i) for i in order]
    sweeps = []
    with num_threads(2):
        ref = case.run(backend, order, grad)
        for i in order:
            sweeps.append(compare(f"alone (sequence {i})", ref, case.run(backend, [i], grad, pad=0), [(i, 0)]))
        sweeps.append(compare("left padding", ref, case.run(backend, order, grad, left=True), same))
        sweeps.append(compare("more padding", ref, case.run(backend, order, grad, pad=40), same))
        sweeps.append(compare("reversed order", ref, case.run(backend, order[::-1], grad),
                               [(i, n - 1 - i) for i in order]))
        sweeps.append(compare("next to a NaN/Inf sequence", ref, case.run(backend, order, grad, garbage=True), same))
        sweeps.append(compare("repeat (determinism)", ref, case.run(backend, order, grad), same))
        last = [(r[0][-1:],) for r in ref]
        sweeps.append(compare("decode (last token alone)", last, case.decode(backend), same))
    with num_threads(1):
        sweeps.append(threads_sweep(backend, compare("threads=1 vs 2", ref, case.run(backend, order, grad), same)))
    acc = _accuracy(case, ref, grad) if with_accuracy else None
    return OpReport("masked_attention", backend, contract.dtype_name(dtype), acc, sweeps)
