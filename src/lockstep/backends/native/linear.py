"""Native linear: the portable op's fixed tiles and orders, with its GEMMs on lockstep's own
kernels (cpu.KERNELS, passed as the portable op's `kernels`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from ..portable import linear as portable
from . import cpu, gemm


@register("native", "linear")
def linear(x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int = 1, split_n: int = 1) -> Tensor:
    if not torch.is_grad_enabled():         # no graph to record (the engine's steps): the forward alone
        return forward(x, weight, bias, split_k)
    return portable.linear(x, weight, bias, split_k, split_n, kernels=cpu.KERNELS)


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, split_k: int = 1) -> Tensor:
    """The portable linear's forward on these kernels (x [M, K], weight [N, K] -> [M, N] in x's
    dtype), with its one kernel call made directly where the operands are already in the kernel's
    layout, as a model's are: the composition's calls cost a decode step more than the kernel."""
    one_call = split_k == 1 or (bias is None and x.shape[0] <= gemm.SPLIT_IN_ONE_CALL_ROWS
                                and gemm.split_parts_supported(x, weight, split_k))
    if one_call and x.dtype == weight.dtype and x.dtype in gemm.OUT_CODES and x.stride(-1) == 1 \
            and weight.stride(-1) == 1 and x.device.type == "cpu" and not gemm.holds_a_copy():
        return gemm.gemm_nt_in_layout(x, weight, bias, x.dtype, split_k)
    return portable.linear_forward(x.contiguous(), weight, bias, split_k, kernels=cpu.KERNELS)


def forward_group(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    """[forward(x, w, b) for w, b in zip(weights, biases)] (x [M, K], each w [N_j, K] -> [M, N_j] in
    x's dtype), in one kernel call where `forward` would make each with one call in the kernel's
    layout: the same bits, since each column is its own dot (`columns_at_any_width`)."""
    if (len(weights) <= gemm.GROUP_MAX and x.dtype in gemm.OUT_CODES and x.stride(-1) == 1 and x.device.type == "cpu"
            and all(w.dtype == x.dtype and w.stride(-1) == 1 for w in weights) and not gemm.holds_a_copy()):
        return gemm.gemm_nt_group_in_layout(x, weights, biases, x.dtype)
    return [forward(x, w, b) for w, b in zip(weights, biases)]


# ops.linears' form of this backend: the engine's projections of one input in one call.
linear.group = forward_group
