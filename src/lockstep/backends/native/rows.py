"""Native row reductions (kernels.c, `ls_rows`): fixed_order.row_sum, and log_softmax's forward and
backward on it, in C. The arithmetic is fixed_order's, operation for operation, so they give the
bits of fixed_order's PyTorch compositions on the native exp and log; they exist for speed, since
those compositions pad, copy and allocate several times the rows' size."""

from __future__ import annotations

import torch
from torch import Tensor

from .build import isa, library

_MODES = {"row_sum": 0, "log_softmax": 1, "log_softmax_backward": 2}


def _rows(mode: str, x: Tensor, y: Tensor | None, out: Tensor) -> Tensor:
    rows, length = x.shape
    status = library().ls_rows(rows, length, x.data_ptr(), None if y is None else y.data_ptr(), out.data_ptr(),
                               _MODES[mode], isa(), torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"ls_rows ({mode}): out of memory for a row of {length} elements")
    if status != 0:
        raise RuntimeError(f"ls_rows refused {mode} of {tuple(x.shape)}")
    return out


def row_sum(x: Tensor) -> Tensor:
    """fixed_order.row_sum of each row of x [M, L] fp32: [M] fp32."""
    x = x.contiguous()
    return _rows("row_sum", x, None, x.new_empty(x.shape[0]))


def log_softmax(x: Tensor) -> Tensor:
    """fixed_order.log_softmax_rows of x [M, V] fp32: y [M, V] fp32."""
    x = x.contiguous()
    return _rows("log_softmax", x, None, torch.empty_like(x))


def log_softmax_backward(g: Tensor, y: Tensor) -> Tensor:
    """fixed_order.log_softmax_rows_backward: dx [M, V] fp32 from g and y [M, V] fp32."""
    g, y = g.contiguous(), y.contiguous()
    return _rows("log_softmax_backward", g, y, torch.empty_like(g))
