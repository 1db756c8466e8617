"""Logit softcapping, cap * tanh(logits / cap): the one definition every backend's LM head applies."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .cpu_kernels import CpuKernels
from .fixed_order import exp


def check(softcap: float | None) -> float | None:
    """A ValueError naming `softcap` unless it is None or a positive finite number."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap: expected a positive finite number or None, got {softcap!r}")
    return float(softcap)


def softcap(logits: Tensor, cap: float, *, kernels: CpuKernels | None = None) -> tuple[Tensor, Tensor]:
    """(cap * tanh(logits / cap), its derivative 1 - tanh^2), elementwise in logits' dtype.

    tanh(z) is evaluated as 1 - 2 / (exp(2z) + 1), from exp (fixed_order.exp on the CPU kernels
    `kernels`, None: PyTorch's) and division, whose bits tests/test_portable.py checks to be the
    same in the vector body and the scalar tail of their loops; torch.tanh's two paths are separate
    implementations with no such promise (as torch's sigmoid and tanh-GELU differ). Large
    |z| saturates to +-1 exactly (exp overflows to inf, or underflows to 0)."""
    t = 2.0 / (exp(logits * (2.0 / cap), kernels=kernels) + 1.0)
    t = 1.0 - t
    return t * cap, 1.0 - t * t
