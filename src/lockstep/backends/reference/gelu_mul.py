"""Float64 reference gelu_mul: the tanh formula as published, written for clarity; shares no code
with the kernels (which use the equivalent sigmoid form)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...registry import register

f64 = torch.float64


def gelu_mul(gate: Tensor, up: Tensor) -> Tensor:
    g = gate.to(f64)
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * up.to(f64)


register("reference", "gelu_mul")(gelu_mul)
