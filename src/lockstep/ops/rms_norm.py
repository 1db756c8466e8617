"""rms_norm: x / rms(x) * (offset + weight), one row at a time."""

from __future__ import annotations

import math

from torch import Tensor

from .. import autocast
from .. import checks as c
from ..registry import fused_form, resolve


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * (offset + weight); offset=1.0 is Gemma's form.

    x: [..., H] float; weight: [H] of x's dtype. Returns [..., H] in x's dtype; fp32 inside.
    """
    x, weight = autocast.cast("rms_norm", x, weight)
    if not _well_formed(x, weight, eps, offset):
        _check(x, weight, eps, offset)
    rows = x.reshape(-1, x.shape[-1])
    with autocast.off(x.device.type):
        y = resolve("rms_norm", x.device)(rows, weight, float(eps), float(offset))
    return y.reshape(x.shape)


def add_rms_norm(residual: Tensor, delta: Tensor, weight: Tensor, eps: float = 1e-6,
                 offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """(residual + delta, rms_norm(residual + delta, weight, eps, offset)): a decoder layer's
    residual add and the RMSNorm that follows it, with the bits of the two.

    residual, delta: [..., H] float of one shape and device (the sum's dtype is PyTorch's promotion
    of theirs, as `+` gives it); weight: [H]. Returns both [..., H]. Where no gradient is recorded,
    autocast is off and residual, delta and weight share a dtype, a backend whose rms_norm carries
    an `add` form (the native and Triton ones) computes them in one pass; elsewhere, the add and
    `rms_norm`.
    """
    if not (isinstance(delta, Tensor) and isinstance(residual, Tensor) and residual.dtype in c.FLOAT_DTYPES
            and delta.dtype in c.FLOAT_DTYPES and delta.shape == residual.shape and delta.device == residual.device):
        c.float_tensor("residual", residual)
        c.float_tensor("delta", delta)
        c.same_device("delta", delta, "residual", residual)
        raise ValueError(f"delta: expected shape {tuple(residual.shape)} (the shape of residual), got {tuple(delta.shape)}")
    if delta.dtype == residual.dtype and not autocast.enabled(residual.device.type) \
            and _well_formed(residual, weight, eps, offset):
        add = fused_form("rms_norm", "add", residual.device)
        if add is not None:
            total, y = add(residual.reshape(-1, residual.shape[-1]), delta.reshape(-1, residual.shape[-1]), weight,
                           eps, offset)
            return total.reshape(residual.shape), y.reshape(residual.shape)
    total = residual + delta
    return total, rms_norm(total, weight, eps, offset)


def _well_formed(x: object, weight: object, eps: object, offset: object) -> bool:
    """Whether `_check` would pass, in one expression (the common call pays for no more)."""
    return (isinstance(x, Tensor) and isinstance(weight, Tensor) and x.dtype in c.FLOAT_DTYPES and x.dim() >= 1
            and weight.dtype == x.dtype and weight.device == x.device and weight.shape == x.shape[-1:]
            and type(eps) is float and 0.0 < eps < math.inf and type(offset) is float and -math.inf < offset < math.inf)


def _check(x: object, weight: object, eps: object, offset: object) -> None:
    c.float_tensor("x", x)
    c.at_least_1d("x", x)
    c.float_tensor("weight", weight)
    c.same_dtype("weight", weight, "x", x)
    c.same_device("weight", weight, "x", x)
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight: expected shape [{x.shape[-1]}] to match x's last dimension, got {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps: expected a positive finite number, got {eps!r}")
    if not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"offset: expected a finite number, got {offset!r}")
