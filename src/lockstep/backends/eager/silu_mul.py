"""Eager silu_mul: torch.nn.functional.silu(gate) * up. Not invariant; for comparison."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ...registry import register


@register("eager", "silu_mul")
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up
