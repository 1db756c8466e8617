"""How the harness builds inputs for each op and calls it.

An OpSpec describes an op in terms of rows: `rows(n)` makes n rows of per-row inputs (every tensor
has the row dimension first; float ones get input gradients), `params()` makes the shared weights,
and `call(ops, rows, params)` runs the op from a module with the lockstep op signatures (lockstep.ops
or lockstep.reference), returning one output row per input row. Inputs are scaled like a real model:
unit-variance activations, 1/sqrt(K) weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sizes:
    hidden: int = 320          # linear K, rms_norm H (not a multiple of the 512-lane sum width)
    out_features: int = 200    # linear N
    heads: int = 3             # rope
    head_dim: int = 64
    ffn: int = 300             # silu_mul, gelu_mul
    vocab: int = 9000          # log_softmax, cross_entropy, selected_logprobs (> 2 vocab chunks)
    lm_hidden: int = 96        # selected_logprobs D
    embed_vocab: int = 50      # embedding: few ids, so ids repeat and the weight gradient adds
    pool: int = 300            # rows in the reference layout: > any row tile, not a multiple of one


LARGE = Sizes(hidden=65536, vocab=152064, pool=6)


@dataclass
class OpSpec:
    name: str
    rows: Callable[[int, torch.Generator, torch.dtype, Sizes], dict[str, Tensor]]
    params: Callable[[torch.Generator, torch.dtype, Sizes], dict[str, Tensor]]
    call: Callable[[object, dict[str, Tensor], dict[str, Tensor]], Tensor]
    # Ops whose large-size check is part of the sweep (`Sizes.hidden`/`Sizes.vocab` at LLM scale).
    large: bool = False
    # Scale of the upstream gradient per element. A loss's gradient with respect to a V-wide row of
    # log-probabilities has a norm of order 1, not unit variance in each of its V elements.
    grad_scale: Callable[[Sizes], float] = lambda s: 1.0
    # False for an inference-only op: its sweeps and accuracy check cover the forward alone.
    differentiable: bool = True


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _randint(gen: torch.Generator, high: int, n: int) -> Tensor:
    return torch.randint(0, high, (n,), generator=gen)


def _spec_list() -> list[OpSpec]:
    return [
        OpSpec(
            "linear",
            rows=lambda n, g, dt, s: {"x": _randn(g, n, s.hidden).to(dt)},
            params=lambda g, dt, s: {"weight": _randn(g, s.out_features, s.hidden, scale=s.hidden ** -0.5).to(dt),
                                     "bias": _randn(g, s.out_features, scale=0.1).to(dt)},
            call=lambda ops, r, p: ops.linear(r["x"], p["weight"], p["bias"]),
        ),
        OpSpec(
            "rms_norm",
            rows=lambda n, g, dt, s: {"x": _randn(g, n, s.hidden).to(dt)},
            params=lambda g, dt, s: {"weight": (1 + _randn(g, s.hidden, scale=0.1)).to(dt)},
            call=lambda ops, r, p: ops.rms_norm(r["x"], p["weight"], eps=1e-6),
            large=True,
        ),
        OpSpec(
            "rope",
            rows=lambda n, g, dt, s: {"x": _randn(g, n, s.heads, s.head_dim).to(dt),
                                      "positions": _randint(g, 40000, n)},
            params=lambda g, dt, s: {},
            call=lambda ops, r, p: ops.rope(r["x"], r["positions"], theta=500000.0, style="neox"),
        ),
        OpSpec(
            "silu_mul",
            rows=lambda n, g, dt, s: {"gate": _randn(g, n, s.ffn).to(dt), "up": _randn(g, n, s.ffn).to(dt)},
            params=lambda g, dt, s: {},
            call=lambda ops, r, p: ops.silu_mul(r["gate"], r["up"]),
        ),
        OpSpec(
            "gelu_mul",
            rows=lambda n, g, dt, s: {"gate": _randn(g, n, s.ffn).to(dt), "up": _randn(g, n, s.ffn).to(dt)},
            params=lambda g, dt, s: {},
            call=lambda ops, r, p: ops.gelu_mul(r["gate"], r["up"]),
        ),
        OpSpec(
            "embedding",
            rows=lambda n, g, dt, s: {"ids": _randint(g, s.embed_vocab, n)},
            params=lambda g, dt, s: {"weight": _randn(g, s.embed_vocab, s.lm_hidden).to(dt)},
            call=lambda ops, r, p: ops.embedding(r["ids"], p["weight"]),
        ),
        OpSpec(
            "log_softmax",
            rows=lambda n, g, dt, s: {"x": _randn(g, n, s.vocab).to(dt)},
            params=lambda g, dt, s: {},
            call=lambda ops, r, p: ops.log_softmax(r["x"]),
            large=True,
            grad_scale=lambda s: s.vocab ** -0.5,
        ),
        OpSpec(
            "selected_logprobs",
            rows=lambda n, g, dt, s: {"hidden": _randn(g, n, s.lm_hidden).to(dt), "targets": _randint(g, s.vocab, n)},
            params=lambda g, dt, s: {"weight": _randn(g, s.vocab, s.lm_hidden, scale=s.lm_hidden ** -0.5).to(dt)},
            call=lambda ops, r, p: ops.selected_logprobs(r["hidden"], p["weight"], r["targets"]),
            large=True,
        ),
        OpSpec(
            "vocab_logprobs",
            rows=lambda n, g, dt, s: {"hidden": _randn(g, n, s.lm_hidden).to(dt)},
            params=lambda g, dt, s: {"weight": _randn(g, s.vocab, s.lm_hidden, scale=s.lm_hidden ** -0.5).to(dt)},
            call=lambda ops, r, p: ops.vocab_logprobs(r["hidden"], p["weight"]),
            large=True,
            differentiable=False,
        ),
        OpSpec(
            "cross_entropy",
            rows=lambda n, g, dt, s: {"logits": _randn(g, n, s.vocab).to(dt), "targets": _randint(g, s.vocab, n)},
            params=lambda g, dt, s: {},
            # Row-wise losses; the mean over rows is checked separately (tests/test_cross_entropy.py).
            call=lambda ops, r, p: ops.cross_entropy(r["logits"], r["targets"], reduction="none"),
        ),
    ]


SPECS: dict[str, OpSpec] = {s.name: s for s in _spec_list()}


def get(name: str) -> OpSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"op: unknown op {name!r}; expected one of {sorted(SPECS)}") from None
