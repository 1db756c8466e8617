"""Eager log_softmax: torch.log_softmax in fp32. Not invariant; for comparison."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register


@register("eager", "log_softmax")
def log_softmax(x: Tensor) -> Tensor:
    return torch.log_softmax(x.float() if x.dtype != torch.float64 else x, dim=-1).to(x.dtype)
