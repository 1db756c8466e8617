"""Eager gelu_mul: torch.nn.functional.gelu(gate, approximate="tanh") * up. Not invariant; for comparison."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ...registry import register


@register("eager", "gelu_mul")
def gelu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.gelu(gate, approximate="tanh") * up
