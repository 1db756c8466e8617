"""The model's modules that each stand for one op, Linear (ops.linear with a layer's split of its
reductions) and RMSNorm, and their fused forms in the engine's forward (docs/adr/0042): `project`
for the projections of one input, `add_norm` for a residual add and the norm after it, and
`plain`, which says when a module's call may be stood for by a fused step."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from .. import ops


class Linear(nn.Module):
    """ops.linear with this layer's split of its reductions: split_n for a layer whose output
    tensor parallelism shards (column-parallel), split_k for one whose input it shards (row-parallel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, split_k: int = 1, split_n: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.split_k, self.split_n = split_k, split_n

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias, split_k=self.split_k, split_n=self.split_n)


def project(x: Tensor, layers: tuple[Linear, ...]) -> list[Tensor]:
    """x [T, K] through each of `layers`, Linears of that input (q, k and v; gate and up): [T, N_j]
    each. Where no gradient is recorded (the engine's steps), plain Linears without hooks go through
    one ops.linears call, one kernel call on the native backend, with the bits of a call each; the
    trainer keeps a call per layer, whose backward sums each layer's dX by itself. A subclass (a
    tensor-parallel layer) or a hooked layer is called as a module."""
    split_n = layers[0].split_n
    if torch.is_grad_enabled() or not all(plain(m, Linear) and m.split_k == 1 and m.split_n == split_n
                                          for m in layers):
        return [m(x) for m in layers]
    return ops.linears(x, [m.weight for m in layers], [m.bias for m in layers], split_n=split_n)


def plain(module: nn.Module, cls: type) -> bool:
    """Whether calling `module` runs `cls.forward` and nothing else: no subclass's or instance's own
    forward (a tensor-parallel layer, an offloading wrapper) and no forward hook, its own or a
    global one. Only then may a fused step stand for the module's call."""
    return (type(module).forward is cls.forward and "forward" not in module.__dict__
            and not (module._forward_hooks or module._forward_pre_hooks or torch_module._global_forward_hooks
                     or torch_module._global_forward_pre_hooks))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.offset)


def add_norm(x: Tensor, delta: Tensor | None, norm: RMSNorm) -> tuple[Tensor, Tensor]:
    """(x + delta, norm(x + delta)) ([T, H] each; x and norm(x) where delta is None). Where no
    gradient is recorded (the engine's steps), a plain RMSNorm without hooks goes through
    ops.add_rms_norm, one pass on the native backend, with the bits of the add and the norm; the
    trainer, and a hooked norm, keep the add and the module call."""
    if delta is None:
        return x, norm(x)
    if torch.is_grad_enabled() or not plain(norm, RMSNorm):
        x = x + delta
        return x, norm(x)
    return ops.add_rms_norm(x, delta, norm.weight, norm.eps, norm.offset)
