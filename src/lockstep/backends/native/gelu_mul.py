"""Native gelu_mul: the forward of a call that records no graph (the engine's steps) is one C pass
(rows.c, `ls_silu` mode 4) performing the portable op's fp32 operations element for element, so
the bits are the portable op's; otherwise the portable op, with its exp on lockstep's own kernels
(cpu.KERNELS, passed as the portable op's `kernels`); the rest is elementwise arithmetic, the same
bits on every CPU."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from ..portable import gelu_mul as portable
from . import cpu, silu


@register("native", "gelu_mul")
def gelu_mul(gate: Tensor, up: Tensor) -> Tensor:
    if not torch.is_grad_enabled():
        gate, up = gate.contiguous(), up.contiguous()
        if silu.takes(gate, up):
            return silu.run("gelu_gated", gate, up)[0]
    return portable.gelu_mul(gate, up, kernels=cpu.KERNELS)
