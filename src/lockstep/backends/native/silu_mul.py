"""Native silu_mul: fp32 and bf16 in one C pass forward and one backward (kernels.c, `ls_silu_mul`),
which perform the portable composition's operations element for element, so both backends give the
same bits (NaN compared as NaN); fp16 takes the portable op on the native exp."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from ..portable import silu_mul as portable
from .build import isa, library
from .cpu import native_kernels
from .gemm import OUT_CODES


def _silu_mul(gate: Tensor, up: Tensor, grad_y: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The forward's y (grad_y None) or (d gate, d up): tensors of gate's shape and dtype."""
    out = torch.empty_like(gate)
    out_up = None if grad_y is None else torch.empty_like(up)
    status = library().ls_silu_mul(gate.numel(), gate.data_ptr(), up.data_ptr(),
                                   None if grad_y is None else grad_y.data_ptr(), out.data_ptr(),
                                   None if out_up is None else out_up.data_ptr(), OUT_CODES[gate.dtype],
                                   grad_y is not None, isa(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"ls_silu_mul refused {gate.numel()} {gate.dtype} elements")
    return out, out_up


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return _silu_mul(gate, up, None)[0]

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        gate, up = ctx.saved_tensors
        return _silu_mul(gate, up, grad_y.to(gate.dtype).contiguous())


@register("native", "silu_mul")
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    if gate.dtype in OUT_CODES and up.dtype == gate.dtype:
        return _SiluMul.apply(gate.contiguous(), up.contiguous())
    with native_kernels():
        return portable.silu_mul(gate, up)
