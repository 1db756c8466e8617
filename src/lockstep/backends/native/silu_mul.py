"""Native silu_mul: fp32 and bf16 in one C pass forward and one backward (silu.py), with the
portable composition's operations element for element, so both backends give the same bits (NaN
compared as NaN); fp16 takes the portable op on the native exp."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from ...numerics.second_order import first_order_only
from ..portable import silu_mul as portable
from . import silu
from . import cpu


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return silu.run("gated", gate, up)[0]

    @staticmethod
    @first_order_only("silu_mul")
    def backward(ctx, grad_y: Tensor):
        gate, up = ctx.saved_tensors
        return silu.run("gated_backward", gate, up, grad_y.to(gate.dtype).contiguous())


@register("native", "silu_mul")
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    if silu.takes(gate, up):
        if not torch.is_grad_enabled():  # no graph to record (the engine's steps): the forward alone
            return silu.run("gated", gate, up)[0]
        return _SiluMul.apply(gate, up)
    return portable.silu_mul(gate, up, kernels=cpu.KERNELS)
