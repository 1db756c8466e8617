"""Eager linear: torch.nn.functional.linear: BLAS picks its kernel (a GEMV for one row) from the
shape. Not invariant; for comparison."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ...registry import register


@register("eager", "linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)
