"""The native backend's CPU kernels as one set (lockstep.numerics.cpu_kernels.CpuKernels): each
native op passes `KERNELS` as the `kernels` argument of the portable composition it runs, and the
registry gives it to the arithmetic around the ops where native is the CPU backend
(`registry.cpu_backend_kernel_set`)."""

from __future__ import annotations

from typing import NoReturn

from ...numerics.cpu_kernels import CpuKernels, removed_selection
from ...registry import register_kernel_set
from . import gemm, rows, silu, unary

KERNELS = CpuKernels("native", gemm.matmul_rows, gemm.weight_grad, unary.exp, unary.log, rows.row_sum,
                     rows.log_softmax, rows.log_softmax_backward, rows.lse_fold, rows.logit_grad,
                     gemm.split_matmul_rows, silu.silu, silu.silu_backward, gemm.weight_grad_node, unary.sqrt,
                     columns_at_any_width=True)
register_kernel_set("native", KERNELS)


def native_kernels() -> NoReturn:
    """Removed: a block no longer selects the kernels of the calls inside it; pass `KERNELS` as the
    `kernels` argument of the fixed-order functions and portable ops instead."""
    raise removed_selection("lockstep.backends.native.cpu.native_kernels",
                            "pass lockstep.backends.native.cpu.KERNELS as the `kernels` argument instead")
