"""Argument checks shared by the public ops. Every message names the argument and what was expected."""

from __future__ import annotations

import math

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def float_tensor(name: str, x: object) -> Tensor:
    x = tensor(name, x)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float32, bfloat16, float16 or float64, got {x.dtype}")
    return x


def int_tensor(name: str, x: object) -> Tensor:
    x = tensor(name, x)
    if x.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected an int64 or int32 tensor, got {x.dtype}")
    return x


def bool_tensor(name: str, x: object) -> Tensor:
    x = tensor(name, x)
    if x.dtype != torch.bool:
        raise TypeError(f"{name}: expected a bool tensor, got {x.dtype}")
    return x


def same_dtype(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}), got {x.dtype}")


def same_device(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on {ref.device} (the device of {ref_name}), got {x.device}")


def ndim(name: str, x: Tensor, expected: int | tuple[int, ...], what: str) -> None:
    allowed = (expected,) if isinstance(expected, int) else expected
    if x.dim() not in allowed:
        raise ValueError(f"{name}: expected {what}, got shape {tuple(x.shape)}")


def at_least_1d(name: str, x: Tensor) -> None:
    if x.dim() < 1:
        raise ValueError(f"{name}: expected at least 1 dimension [..., features], got a scalar")


def in_range(name: str, ids: Tensor, upper: int, ignore: int | None = None) -> None:
    """All ids in [0, upper) (ids equal to `ignore` excepted)."""
    if ids.numel() == 0:
        return
    check = ids if ignore is None else ids[ids != ignore]
    if check.numel() == 0:
        return
    lo, hi = int(check.min()), int(check.max())
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        extra = f" or {ignore} (ignore_index)" if ignore is not None else ""
        raise ValueError(f"{name}: expected values in [0, {upper}){extra}, found {bad}")


def lm_head(hidden: object, weight: object) -> None:
    """hidden [..., D] float and weight [V, D], the LM head of hidden's dtype and device."""
    float_tensor("hidden", hidden)
    at_least_1d("hidden", hidden)
    float_tensor("weight", weight)
    ndim("weight", weight, 2, "a 2-D LM head [vocab, hidden]")
    same_dtype("weight", weight, "hidden", hidden)
    same_device("weight", weight, "hidden", hidden)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: expected shape [V, {hidden.shape[-1]}] to match hidden's last dimension, "
                         f"got {tuple(weight.shape)}")


def temperature(value: object) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"temperature: expected a positive finite number, got {value!r}")


def int_at_least(name: str, value: object, minimum: int = 1) -> int:
    """`value` when it is an int (not a bool) >= minimum; a ValueError naming `name` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return value


def one_of(name: str, value: object, choices: tuple) -> None:
    """A ValueError naming `name` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
