"""Float64 reference cross_entropy: the textbook formula, written for clarity; shares no code with
the kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from .log_softmax import log_softmax


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    logp = log_softmax(logits)
    valid = targets != ignore_index
    nll = -logp.gather(-1, torch.where(valid, targets, 0).long()[..., None])[..., 0]
    nll = torch.where(valid, nll, torch.zeros_like(nll))
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / valid.sum()


register("reference", "cross_entropy")(cross_entropy)
