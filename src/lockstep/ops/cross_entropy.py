"""cross_entropy with PyTorch's semantics, in a fixed reduction order."""

from __future__ import annotations

from torch import Tensor

from .. import autocast
from .. import checks as c
from ..registry import resolve

REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """-log softmax(logits)[target], reduced like torch.nn.functional.cross_entropy.

    logits: [..., V] float; targets: [...] int in [0, V) or equal to ignore_index.
    reduction "mean" divides by the number of non-ignored targets (NaN when every target is
    ignored, as in PyTorch); "sum"; "none" gives [...] with 0 at ignored targets.
    Returns a scalar (or [...] for "none") in logits' dtype; the sum over rows runs in a
    fixed order, so appending ignored rows changes no bit.
    """
    (logits,) = autocast.cast("cross_entropy", logits)
    c.float_tensor("logits", logits)
    c.at_least_1d("logits", logits)
    c.int_tensor("targets", targets)
    c.same_device("targets", targets, "logits", logits)
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets: expected shape {tuple(logits.shape[:-1])} (logits without its last dimension), got {tuple(targets.shape)}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    c.in_range("targets", targets, logits.shape[-1], ignore=ignore_index)
    with autocast.off(logits.device.type):
        out = resolve("cross_entropy", logits.device)(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), ignore_index, reduction)
    return out.reshape(targets.shape) if reduction == "none" else out
