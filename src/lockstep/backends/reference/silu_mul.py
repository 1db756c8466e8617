"""Float64 reference silu_mul: the textbook formula, written for clarity; shares no code with the
kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register

f64 = torch.float64


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    g = gate.to(f64)
    return g / (1 + torch.exp(-g)) * up.to(f64)


register("reference", "silu_mul")(silu_mul)
