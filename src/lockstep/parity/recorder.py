"""lockstep.parity.recorder: every op call of a forward and backward pass, through the op registry's hook,
with its module path, bits digest and (optionally) the tensor; `RowView` restricts a recording to one
sequence."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from .. import registry



@dataclass
class OpRecord:
    index: int
    phase: str               # "forward" or "backward"
    module: str
    op: str
    slot: str                # "out", or "grad:<input index>" in backward
    shape: list[int]
    dtype: str
    digest: str
    max_abs: float
    norm64: float
    tensor: Tensor | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.module or '<top>'}:{self.op}[{self.slot}]"


def tensor_summary(t: Tensor) -> tuple[str, float, float]:
    t = t.detach()
    digest = hashlib.sha1(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    if t.numel() == 0:
        return digest, 0.0, 0.0
    d = t.double()
    return digest, float(torch.nan_to_num(d.abs(), nan=math.inf).max()), float(torch.linalg.vector_norm(d))


class _Tap(torch.autograd.Function):
    """Identity; in backward it records the gradient that one op sends to one of its inputs."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.callback(g)
        return g, None


class Recorder:
    """`with Recorder(model) as rec:` records every lockstep op call in the block (and its backward).

    model: optional; when given, records carry the path of the module that called the op."""

    def __init__(self, model: nn.Module | None = None, keep_tensors: bool = True):
        self.model, self.keep = model, keep_tensors
        self.forward: list[OpRecord] = []
        self.backward: list[OpRecord] = []
        self._stack: list[str] = []
        self._hooks: list = []

    def __enter__(self) -> "Recorder":
        if self.model is not None:
            for name, module in self.model.named_modules():
                self._hooks.append(module.register_forward_pre_hook(self._enter_module(name)))
                self._hooks.append(module.register_forward_hook(self._leave_module))
        registry.RECORDERS.append(self)
        return self

    def _enter_module(self, name: str) -> Callable:
        def hook(module, args) -> None:
            self._stack.append(name)
        return hook

    def _leave_module(self, module, args, output) -> None:
        self._stack.pop()     # returns None, so the module's output is left alone

    def __exit__(self, *exc) -> None:
        registry.RECORDERS.remove(self)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _record(self, phase: str, module: str, op: str, slot: str, t: Tensor) -> None:
        digest, mx, norm = tensor_summary(t)
        target = self.forward if phase == "forward" else self.backward
        target.append(OpRecord(len(target), phase, module, op, slot, list(t.shape), str(t.dtype).removeprefix("torch."),
                               digest, mx, norm, t.detach().clone() if self.keep else None))

    def wrap(self, op: str, impl: Callable) -> Callable:
        def recorded(*args, **kwargs):
            module = self._stack[-1] if self._stack else ""
            tapped = list(args)
            for i, a in enumerate(args):
                if isinstance(a, Tensor) and a.is_floating_point() and a.requires_grad:
                    tapped[i] = _Tap.apply(a, lambda g, i=i: self._record("backward", module, op, f"grad:{i}", g))
            out = impl(*tapped, **kwargs)
            self._record("forward", module, op, "out", out)
            return out
        return recorded


@dataclass
class RowView:
    """Which rows of a recording belong to the sequence under comparison.

    tokens: (start, stop) of its tokens in the packed batch of n_tokens; tensors whose first
    dimension is n_tokens are cut to those rows. Logprob outputs (one row per predicted token,
    n_tokens - n_seqs rows) are cut to the sequence's predictions. Other tensors (weights and
    their gradients) are compared whole, and only when their shapes agree."""

    n_tokens: int
    n_seqs: int
    tokens: tuple[int, int]
    seq_index: int

    def select(self, t: Tensor) -> Tensor | None:
        a, b = self.tokens
        if t.dim() >= 1 and t.shape[0] == self.n_tokens:
            return t[a:b]
        if t.dim() >= 1 and t.shape[0] == self.n_tokens - self.n_seqs:
            return t[a - self.seq_index:b - self.seq_index - 1]
        return t
