"""Native row reductions (rows.c's `ls_rows`, lm_head.c's `ls_logit_rows`): fixed_order.row_sum,
log_softmax's forward and backward on it, and the LM head's per-chunk lse_fold and logit_grad, in
C. The arithmetic is fixed_order's, operation for operation, so they give the bits of fixed_order's
PyTorch compositions on the native exp and log; they exist for speed, since those compositions
pad, copy and allocate several times the rows' size."""

from __future__ import annotations

import torch
from torch import Tensor

from .build import isa, library
from .gemm import DTYPE_CODES

_MODES = {"row_sum": 0, "log_softmax": 1, "log_softmax_backward": 2}


def _rows(mode: str, x: Tensor, y: Tensor | None, out: Tensor) -> Tensor:
    rows, length = x.shape
    if rows == 0:           # nothing to compute (an empty tensor's data pointer may be NULL)
        return out
    status = library().ls_rows(rows, length, x.data_ptr(), None if y is None else y.data_ptr(), out.data_ptr(),
                               _MODES[mode], isa(), torch.get_num_threads())
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


def _per_row(t: Tensor, rows: int, dtype: torch.dtype, name: str) -> Tensor:
    """t as the C side reads it: `rows` contiguous elements of dtype."""
    if tuple(t.shape) != (rows,):
        raise ValueError(f"{name}: expected shape [{rows}], got {list(t.shape)}")
    return t.to(dtype).contiguous()


def _logit_rows(chunk: Tensor, temperature: float, mode: int, first: bool, run: tuple[Tensor, Tensor] | None = None,
                per_row: tuple[Tensor, Tensor, Tensor, Tensor] | None = None, out: Tensor | None = None,
                width: int | None = None) -> None:
    rows, length = chunk.shape
    if width is not None and width < 1:
        raise ValueError(f"width: expected a positive number of columns, got {width}")
    width = length if width is None else min(width, length)
    if chunk.stride(-1) != 1 or (rows > 1 and chunk.stride(0) < length):
        chunk = chunk.contiguous()
    ld = chunk.stride(0) if rows > 1 else length
    run_max, run_sum = run if run is not None else (None, None)
    lse, local, inside, scale = per_row if per_row is not None else (None, None, None, None)

    def ptr(t: Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    status = library().ls_logit_rows(
        rows, length, width, chunk.data_ptr(), ld, DTYPE_CODES[chunk.dtype], temperature, mode, int(first),
        ptr(run_max), ptr(run_sum), ptr(lse), ptr(local), ptr(inside), ptr(scale), ptr(out),
        0 if out is None else DTYPE_CODES[out.dtype], isa(), torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"ls_logit_rows: out of memory for a row of {length} elements")
    if status != 0:
        raise RuntimeError(f"ls_logit_rows refused mode {mode} on {tuple(chunk.shape)} {chunk.dtype}")


def lse_fold(chunk: Tensor, temperature: float, run: tuple[Tensor, Tensor] | None,
             width: int | None = None) -> tuple[Tensor, Tensor]:
    """fixed_order.lse_fold: chunk [T, L] fp32, bf16 or fp16; run and the result ([T] fp32 each).
    width: fold its consecutive pieces of that many columns one after another, in one call."""
    rows = chunk.shape[0]
    if run is None:
        new = (chunk.new_empty(rows, dtype=torch.float32), chunk.new_empty(rows, dtype=torch.float32))
    else:
        new = tuple(_per_row(t, rows, torch.float32, name).clone() for t, name in zip(run, ("run max", "run sum")))
    _logit_rows(chunk, temperature, 0, run is None, run=new, width=width)
    return new


def logit_grad(chunk: Tensor, temperature: float, lse: Tensor, local: Tensor, inside: Tensor, scale: Tensor,
               out_dtype: torch.dtype) -> Tensor:
    """fixed_order.logit_grad: chunk [T, L] fp32, bf16 or fp16; lse, inside, scale [T] (as fp32);
    local [T] (as int64, each in [0, L)); the result [T, L] in out_dtype (fp32 or bf16)."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype: expected torch.float32 or torch.bfloat16, got {out_dtype}")
    rows = chunk.shape[0]
    per_row = (_per_row(lse, rows, torch.float32, "lse"), _per_row(local, rows, torch.int64, "local"),
               _per_row(inside, rows, torch.float32, "inside"), _per_row(scale, rows, torch.float32, "scale"))
    out = chunk.new_empty(chunk.shape, dtype=out_dtype)
    _logit_rows(chunk, temperature, 1, False, per_row=per_row, out=out)
    return out
