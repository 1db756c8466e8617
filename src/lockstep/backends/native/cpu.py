"""The native backend's CPU kernels as one set (lockstep.numerics.cpu_kernels.CpuKernels), and the block that selects them."""

from __future__ import annotations

import contextlib
from typing import Iterator

from ...numerics.cpu_kernels import CpuKernels, cpu_kernels, register_cpu_kernels
from . import gemm, rows, silu, unary

KERNELS = CpuKernels("native", gemm.matmul_rows, gemm.weight_grad, unary.exp, unary.log, rows.row_sum,
                     rows.log_softmax, rows.log_softmax_backward, rows.lse_fold, rows.logit_grad,
                     gemm.split_matmul_rows, silu.silu, silu.silu_backward, gemm.weight_grad_node, unary.sqrt,
                     columns_at_any_width=True)
register_cpu_kernels(KERNELS)


@contextlib.contextmanager
def native_kernels() -> Iterator[None]:
    """The block's CPU GEMMs, exp, log and sqrt on the native kernels."""
    with cpu_kernels(KERNELS.name):
        yield
