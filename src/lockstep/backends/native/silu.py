"""Native SiLU (rows.c, `ls_silu`): one C pass each for silu_mul's forward and backward (gated,
silu_mul.py) and for SiLU alone (`silu`, `silu_backward`: the CPU kernels' forms of fixed_order.silu
and its backward, which the batch-invariant mode runs), in fp32 and bf16, performing the
compositions' operations element for element, so they give the compositions' bits (NaN compared
as NaN). Other dtypes take the compositions (fixed_order's, on the native exp)."""

from __future__ import annotations

import torch
from torch import Tensor

from .build import isa, library
from .gemm import OUT_CODES

_MODES = {"gated": 0, "gated_backward": 1, "silu": 2, "silu_backward": 3, "gelu_gated": 4}


def run(mode: str, gate: Tensor, up: Tensor | None = None, grad_y: Tensor | None = None) -> tuple[Tensor, ...]:
    """One C pass of `mode` over contiguous tensors of one dtype (fp32 or bf16): (y,), or the
    gradients ((d gate, d up) gated, (d gate,) alone), each of gate's shape and dtype. Mode
    "gelu_gated" is gelu_mul's forward."""
    out = torch.empty_like(gate)
    out_up = torch.empty_like(gate) if mode == "gated_backward" else None
    pointers = (None if t is None else t.data_ptr() for t in (gate, up, grad_y, out, out_up))
    status = library().ls_silu(gate.numel(), *pointers, OUT_CODES[gate.dtype], _MODES[mode], isa(),
                               torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"ls_silu refused {mode} of {gate.numel()} {gate.dtype} elements")
    return (out,) if out_up is None else (out, out_up)


def takes(*tensors: Tensor) -> bool:
    """Whether the C pass takes these tensors: fp32 or bf16, all of one dtype and shape, and
    contiguous (the compositions' results keep another layout of their inputs, which the C pass,
    writing rows, would not)."""
    first = tensors[0]
    return first.dtype in OUT_CODES and all(t.dtype == first.dtype and t.shape == first.shape and t.is_contiguous()
                                            for t in tensors)


def silu(x: Tensor) -> Tensor | None:
    """fixed_order.silu: x * (1 / (1 + exp(-x))), x's shape and dtype; None where the C pass does not
    take x (fixed_order.silu then runs the composition on the native exp)."""
    if not takes(x):
        return None
    return run("silu", x)[0]


def silu_backward(grad_y: Tensor, x: Tensor) -> Tensor | None:
    """fixed_order.silu_backward: grad_y * (s + x * s * (1 - s)), s = 1 / (1 + exp(-x)); x's dtype;
    None where the C pass does not take them (then the composition runs, as for `silu`)."""
    if not takes(x, grad_y):
        return None
    return run("silu_backward", x, grad_y=grad_y)[0]
