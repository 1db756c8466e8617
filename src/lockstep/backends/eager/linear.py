"""Eager linear: torch.nn.functional.linear: BLAS picks its kernel (a GEMV for one row) from the
shape. Not invariant; for comparison."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ...registry import register


@register("eager", "linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int = 1, split_n: int = 1) -> Tensor:
    # The splits fix a reduction order; eager leaves the order to BLAS, so it has none to fix.
    return F.linear(x, weight, bias)
