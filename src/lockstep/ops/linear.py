"""linear: y = x @ weight.T + bias, row-invariant."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .. import autocast
from .. import checks as c
from ..registry import fused_form, resolve


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, split_k: int = 1, split_n: int = 1) -> Tensor:
    """y = x @ weight.T + bias.

    x: [..., K] float; weight: [N, K] (nn.Linear layout) and bias: [N], both of x's dtype and device.
    Returns [..., N] in x's dtype; fp32 accumulation. Every leading index of x is an independent row.

    split_k cuts the forward's reduction over K into that many equal parts, and split_n the input
    gradient's reduction over N, combined by the canonical tree (lockstep.numerics.fixed_order.split_sum):
    the order a tensor-parallel layer needs to give the same bits at every tensor-parallel size
    (docs/adr/0007). Each must divide its dimension.
    """
    x, weight, bias = autocast.cast("linear", x, weight, bias)
    if not _well_formed(x, weight, bias, split_k, split_n):
        _check(x, weight, bias, split_k, split_n)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    with autocast.off(x.device.type):
        impl = resolve("linear", x.device)
        y = impl(rows, weight, bias) if split_k == split_n == 1 else impl(rows, weight, bias, split_k, split_n)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])


def linears(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None] | None = None, *,
            split_n: int = 1) -> list[Tensor]:
    """[linear(x, w, b, split_n=split_n) for w, b in zip(weights, biases)]: the projections of one
    input (q, k and v; gate and up), with those bits.

    x: [..., K]; each weight [N_j, K] and bias [N_j] (or None), as `linear` takes them; returns a
    [..., N_j] tensor per weight. Where no gradient is recorded and autocast is off, a backend whose
    `linear` carries a `group` form (the native and Triton ones: each product's columns are
    computed as its own call computes them) makes them in one kernel call; elsewhere, a `linear`
    call each.
    """
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"biases: expected one per weight ({len(weights)}), got {len(biases)}")
    if isinstance(x, Tensor) and not autocast.enabled(x.device.type):     # (under autocast: linear's casts and checks)
        for i, (w, b) in enumerate(zip(weights, biases)):
            if not _well_formed(x, w, b, 1, split_n):
                _check(x, w, b, 1, split_n, f"weights[{i}]", f"biases[{i}]")
    if isinstance(x, Tensor) and not autocast.enabled(x.device.type):
        group = fused_form("linear", "group", x.device)
        if group is not None:
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            ys = group(rows, list(weights), biases)
            return ys if x.dim() == 2 else [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]
    return [linear(x, w, b, split_n=split_n) for w, b in zip(weights, biases)]


def _well_formed(x: object, weight: object, bias: object, split_k: object, split_n: object) -> bool:
    """Whether `_check` would pass, in one expression: the common call, a model's own layers', pays
    for no more than this; any other goes through `_check`, which names what is wrong."""
    return (isinstance(x, Tensor) and isinstance(weight, Tensor) and x.dtype in c.FLOAT_DTYPES
            and weight.dtype == x.dtype and x.dim() >= 1 and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
            and weight.device == x.device
            and (bias is None or (isinstance(bias, Tensor) and bias.dtype == x.dtype and bias.device == x.device
                                  and bias.shape == weight.shape[:1]))
            and type(split_k) is int and split_k >= 1 and weight.shape[1] % split_k == 0
            and type(split_n) is int and split_n >= 1 and weight.shape[0] % split_n == 0)


def _check(x: object, weight: object, bias: object, split_k: object, split_n: object,
           weight_name: str = "weight", bias_name: str = "bias") -> None:
    c.float_tensor("x", x)
    c.at_least_1d("x", x)
    c.float_tensor(weight_name, weight)
    c.ndim(weight_name, weight, 2, "a 2-D weight [out_features, in_features]")
    c.same_dtype(weight_name, weight, "x", x)
    c.same_device(weight_name, weight, "x", x)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{weight_name}: expected shape [N, {x.shape[-1]}] to match x's last dimension, got "
                         f"{tuple(weight.shape)}")
    if bias is not None:
        c.float_tensor(bias_name, bias)
        c.same_dtype(bias_name, bias, "x", x)
        c.same_device(bias_name, bias, "x", x)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{bias_name}: expected shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    for name, split, size in (("split_k", split_k, weight.shape[1]), ("split_n", split_n, weight.shape[0])):
        if not isinstance(split, int) or isinstance(split, bool) or split < 1 or size % split:
            raise ValueError(f"{name}: expected a positive int that divides {size}, got {split!r}")
