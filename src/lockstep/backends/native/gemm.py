"""The native GEMMs: `matmul_rows` and `weight_grad` on lockstep's own kernels (gemm.c).

Every GEMM becomes one "NT" product C[m, n] = dot(A[m, :], B[n, :]) over rows whose K elements are
contiguous, which gemm.c computes in one fixed order per output (16 lanes over K, each one FMA
chain from k = 0, folded by a fixed tree). Operands in another layout are copied into that one
first: a copy moves values and changes no bit. bf16 and fp16 operands go to the kernel as they are
and are widened exactly there; other mixes are widened to fp32 here, which gives the same values.
float64 operands (either one) make a float64 product, in the same order in double precision
(`ls_gemm_nt_f64`, docs/adr/0027).
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

from ...numerics import fixed_order
from .build import isa, library

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
OUT_CODES = {torch.float32: 0, torch.bfloat16: 1}


# A large operand copy takes the buffer of the previous GEMM call's largest copy when that is big
# enough, and each call leaves its own largest copy's buffer for the next call, which takes it or
# lets it go: so at most one buffer is held, and only until the next GEMM. The LM head's backward
# makes two copies the size of its weight in consecutive calls (d(hidden) needs the weight
# transposed, the weight gradient the logits' gradient transposed); the second then reuses the
# first's memory instead of page-faulting a fresh one in (hundreds of MB at a real vocabulary).
_REUSE_FROM_BYTES = 64 << 20
_kept: list[Tensor] = []  # at most one uint8 buffer
_kept_lock = threading.Lock()


class _Copies:
    """The buffers of one GEMM call's operand copies (see _REUSE_FROM_BYTES); `close` when done."""

    def __init__(self) -> None:
        with _kept_lock:
            self.spare = _kept.pop() if _kept else None
        self.largest: Tensor | None = None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < _REUSE_FROM_BYTES:
            return torch.empty(shape, dtype=dtype)
        if self.spare is not None and self.spare.numel() >= nbytes:
            buffer, self.spare = self.spare, None
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        if self.largest is None or buffer.numel() > self.largest.numel():
            self.largest = buffer
        return buffer[:nbytes].view(dtype).view(shape)

    def close(self) -> None:
        with _kept_lock:
            _kept.clear()
            if self.largest is not None:
                _kept.append(self.largest)
        self.spare = self.largest = None


def _let_go_of_kept() -> None:
    with _kept_lock:
        _kept.clear()


def _rows_are_contiguous(x: Tensor) -> bool:
    return x.stride(-1) == 1 or x.shape[-1] <= 1


def _rows_contiguous(x: Tensor, copies: _Copies | None = None) -> Tensor:
    """x with unit stride along its last dimension (a copy only when needed, into `copies`' buffers
    when given: the copy must then die with the GEMM call). A transposed matrix (unit stride along
    the second-last dimension), the usual case, is copied by the kernels' blocked transpose, several
    times faster than torch's copy at these sizes."""
    if _rows_are_contiguous(x):
        return x
    if x.dim() not in (2, 3) or x.stride(-2) != 1 or x.element_size() not in (2, 4):
        return x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype) if copies is None else copies.empty(tuple(x.shape), x.dtype)
    batched = x.dim() == 3
    rows, cols = x.shape[-2], x.shape[-1]
    status = library().ls_transpose(
        x.shape[0] if batched else 1, cols, rows, x.data_ptr(), x.stride(-1), x.stride(0) if batched else 0,
        out.data_ptr(), cols, rows * cols, x.element_size(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"ls_transpose refused a {tuple(x.shape)} {x.dtype} copy")
    return out


def gemm_nt(a: Tensor, b: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
            out_dtype: torch.dtype = torch.float32, parts: int = 1) -> Tensor:
    """dot products of rows: a [M, K] or [B, M, K], b [N, K] or [B, N, K] (any dtype of fp32, bf16,
    fp16; any row and batch strides) -> [(B,) M, N] in `out_dtype`, plus an fp32-widened bias [N]
    added once after each dot. out_dtype fp32 keeps each dot's fp32 result; bf16 rounds it in the
    kernel to the bits `.to(torch.bfloat16)` gives, without an fp32 copy. `out`: a tensor of that
    shape and dtype with unit column stride, written in place. parts > 1: each dot cut into that
    many slices of K, each stored in out_dtype and summed by the canonical tree in it (gemm.c's
    gemm_split_tile); `split_parts_supported` says where the kernel takes that. float64 operands
    (either one; the other is widened exactly) need out_dtype float64 and parts 1, and take a
    float64 bias."""
    if a.dim() != b.dim() or a.dim() not in (2, 3) or a.shape[-1] != b.shape[-1] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"a, b: expected [(B,) M, K] and [(B,) N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if torch.float64 in (a.dtype, b.dtype):
        if out_dtype != torch.float64 or parts != 1:
            raise ValueError(f"out_dtype, parts: float64 operands give a float64 product in one part, got "
                             f"{out_dtype} in {parts}")
        a, b = a.double(), b.double()
    elif out_dtype not in OUT_CODES:
        raise ValueError(f"out_dtype: expected torch.float32 or torch.bfloat16 (torch.float64 for float64 operands), "
                         f"got {out_dtype}")
    elif a.dtype != b.dtype or a.dtype not in DTYPE_CODES:
        a, b = a.float(), b.float()
    if _rows_are_contiguous(a) and _rows_are_contiguous(b):  # the usual case: no copy, no bookkeeping
        if _kept:
            _let_go_of_kept()  # a call without a copy
        return _gemm_nt(a, b, bias, out, out_dtype, parts)
    copies = _Copies()
    try:
        return _gemm_nt(_rows_contiguous(a, copies), _rows_contiguous(b, copies), bias, out, out_dtype, parts)
    finally:
        copies.close()


def holds_a_copy() -> bool:
    """Whether a buffer of an earlier call's copy is held (gemm_nt lets it go on a call without one)."""
    return bool(_kept)


def gemm_nt_in_layout(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype, parts: int = 1) -> Tensor:
    """gemm_nt(a, b, bias, out_dtype=out_dtype, parts=parts) for operands gemm_nt would pass on as
    they are: rows contiguous, one dtype of fp32 and bf16, no buffer held (`holds_a_copy`), parts
    that `split_parts_supported` takes. The same kernel call, without gemm_nt's sorting of cases."""
    return _gemm_nt(a, b, bias, None, out_dtype, parts)


# ls_gemm_nt_group's most products in one call: q, k and v.
GROUP_MAX = 3


def gemm_nt_group_in_layout(a: Tensor, bs: list[Tensor], biases: list[Tensor | None],
                            out_dtype: torch.dtype) -> list[Tensor]:
    """[gemm_nt_in_layout(a, b, bias, out_dtype) for b, bias in zip(bs, biases)] in one kernel call
    (ls_gemm_nt_group): a [M, K], each b [N_j, K], up to GROUP_MAX of them, under
    gemm_nt_in_layout's conditions and in one dtype -> [M, N_j] each. The same bits: each output is
    its own dot whatever the products beside it; the threads wake once for all of them."""
    m, k = a.shape
    args: list = []
    outs = []
    for b, bias in zip(bs, biases):
        n = b.shape[0]
        out = torch.empty((m, n), dtype=out_dtype)
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        args += [b.data_ptr(), b.stride(0) if n > 1 else k, n, out.data_ptr(), n, None if bias is None else bias.data_ptr()]
        outs.append((out, bias))                # the bias copy lives until the call returns
    args += [None, 0, 0, None, 0, None] * (GROUP_MAX - len(bs))
    status = library().ls_gemm_nt_group(m, k, a.data_ptr(), a.stride(0) if m > 1 else k, *args,
                                        DTYPE_CODES[a.dtype], OUT_CODES[out_dtype], isa(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"ls_gemm_nt_group refused a [{m}, {k}] {a.dtype} input to "
                           f"{[tuple(b.shape) for b in bs]} {[b.dtype for b in bs]}")
    return [out for out, _ in outs]


def _gemm_nt(a: Tensor, b: Tensor, bias: Tensor | None, out: Tensor | None, out_dtype: torch.dtype,
             parts: int) -> Tensor:
    """gemm_nt on operands whose rows are contiguous."""
    shape = a.shape[:-1] + (b.shape[-2],)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype)
    elif out.shape != shape or out.dtype != out_dtype or (out.shape[-1] > 1 and out.stride(-1) != 1):
        raise ValueError(f"out: expected a {out_dtype} tensor of shape {tuple(shape)} with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if bias is not None:
        bias = bias.to(torch.float64 if out_dtype == torch.float64 else torch.float32).contiguous()
    batched = a.dim() == 3
    bsz = a.shape[0] if batched else 1
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-2]
    if out_dtype == torch.float64:
        status = library().ls_gemm_nt_f64(
            bsz, m, n, k,
            a.data_ptr(), a.stride(-2) if m > 1 else k, a.stride(0) if batched else 0,
            b.data_ptr(), b.stride(-2) if n > 1 else k, b.stride(0) if batched else 0,
            out.data_ptr(), out.stride(-2) if m > 1 else n, out.stride(0) if batched else 0,
            None if bias is None else bias.data_ptr(), isa(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"ls_gemm_nt_f64 refused a [{bsz}, {m}, {k}] x [{n}, {k}] product")
        return out
    status = library().ls_gemm_nt(
        bsz, m, n, k,
        a.data_ptr(), a.stride(-2) if m > 1 else k, a.stride(0) if batched else 0,
        b.data_ptr(), b.stride(-2) if n > 1 else k, b.stride(0) if batched else 0,
        out.data_ptr(), out.stride(-2) if m > 1 else n, out.stride(0) if batched else 0,
        None if bias is None else bias.data_ptr(),
        DTYPE_CODES[a.dtype], OUT_CODES[out_dtype], parts, isa(), torch.get_num_threads())
    if status != 0:
        split = f" in {parts} parts" if parts != 1 else ""
        raise RuntimeError(f"ls_gemm_nt refused a [{bsz}, {m}, {k}] x [{n}, {k}] {a.dtype} product{split}")
    return out


def _like_first(first: Tensor, other: Tensor) -> Tensor:
    """`other` as the product with `first` takes it: a float64 `other` beside a 16- or 32-bit `first`
    is rounded to fp32 (as torch_weight_grad rounds it, and these kernels did before they took
    float64), so the product's dtype follows `first`; gemm_nt makes any product with a float64
    operand a float64 one."""
    return other.float() if other.dtype == torch.float64 and first.dtype != torch.float64 else other


def matmul_rows(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a @ b (+ bias): a [(B,) M, K], b [(B,) K, N] (a transposed view is free) -> a's dtype. A bf16
    result is rounded in the kernel (the bits of the fp32 result's `.to(torch.bfloat16)`)."""
    b = _like_first(a, b)
    out_dtype = torch.bfloat16 if a.dtype == torch.bfloat16 else fixed_order.accumulate_dtype(a.dtype)
    out = gemm_nt(a, b.transpose(-1, -2), bias, out_dtype=out_dtype)
    return out if out.dtype == a.dtype else out.to(a.dtype)


# gemm.c's limits on a split dot: MAX_PARTS slices, each under KC_FROM_BYTES.
_MAX_PARTS, _SLICE_BYTES = 16, 8192


def split_parts_supported(a: Tensor, b: Tensor, parts: int) -> bool:
    """Whether gemm_nt(a, b, parts=parts) runs in one kernel call: 2-D fp32 or bf16 operands of one
    dtype, parts a power of two up to 16 dividing K, each slice under 8 KB of a row."""
    k = a.shape[-1]
    return (a.dim() == b.dim() == 2 and a.dtype == b.dtype and a.dtype in OUT_CODES and 1 < parts <= _MAX_PARTS
            and parts & (parts - 1) == 0 and k % parts == 0 and k // parts * a.element_size() < _SLICE_BYTES)


# Up to this many rows a split product runs as one call, which saves the composition's per-call
# costs (decode's case); more rows run faster as the composition, whose slices are a part of the
# row each and so stay in cache (docs/benchmarks.md).
SPLIT_IN_ONE_CALL_ROWS = 32


def split_matmul_rows(a: Tensor, b: Tensor, parts: int) -> Tensor:
    """fixed_order.split_sum of matmul_rows over `parts` slices of K (a [M, K], b [K, N], a's dtype
    out): for a few rows in one kernel call with the composition's bits, else the composition."""
    if a.shape[0] > SPLIT_IN_ONE_CALL_ROWS or not split_parts_supported(a, b, parts):
        return fixed_order.split_sum(lambda s, e: matmul_rows(a[:, s:e], b[s:e]), a.shape[-1], parts)
    return gemm_nt(a, b.transpose(-1, -2), out_dtype=a.dtype, parts=parts)


def weight_grad(grad_out: Tensor, inp: Tensor, out: Tensor | None = None) -> Tensor:
    """sum over rows r of grad_out[r]^T inp[r]: [(B,) M, N], [(B,) M, K] -> fp32 [(B,) N, K], float64
    for float64 grad_out (into `out`, a contiguous tensor of that dtype, when given). The rows are
    the reduction axis, so both operands are transposed into row-contiguous copies first."""
    shape = tuple(grad_out.shape[:-2]) + (grad_out.shape[-1], inp.shape[-1])
    dtype = fixed_order.accumulate_dtype(grad_out.dtype)
    inp = _like_first(grad_out, inp)
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous {dtype} tensor of shape {shape}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return gemm_nt(_rows_contiguous(grad_out.transpose(-1, -2)), _rows_contiguous(inp.transpose(-1, -2)), out=out,
                   out_dtype=dtype)


# Units of up to this many bytes of a row go in one call. Past it the separate GEMMs win: each works
# on a tight copy of its own rows that stays in cache, while the one call walks every unit's slice
# of a tile's rows before the next tile. 8 units on 2 threads, one call over separate: 0.55-0.67 at
# 128-256 bytes, 0.84-0.92 at 768, 1.09-1.32 at 1024 (docs/adr/0017's later section).
_NODE_UNIT_BYTES = 768


def weight_grad_node(grad_out: Tensor, inp: Tensor, bounds: list[int], out: Tensor) -> Tensor | None:
    """fixed_order.weight_grad_node in one kernel call: the canonical tree's node over the units
    whose rows of grad_out [M, N] and inp [M, K] are bounds[u] .. bounds[u + 1] (from 0 to M), each
    unit's leaf its own weight_grad, into `out` (a contiguous fp32 [N, K]). The units are slices of
    the rows, which are the GEMM's K, so both operands are transposed into row-contiguous copies
    once for all of them. None (nothing written) where a unit is longer than _NODE_UNIT_BYTES: the
    caller's separate GEMMs are faster there. The bits are the separate GEMMs' and adds', a NaN's
    sign and payload aside (each GEMM stores a bf16 dot's NaN as one pattern; here the node does).
    None for a float64 grad_out, whose node the composition computes."""
    if grad_out.dtype == torch.float64:
        return None
    inp = _like_first(grad_out, inp)
    element = 4 if grad_out.dtype != inp.dtype or grad_out.dtype not in DTYPE_CODES else grad_out.element_size()
    if max(b - a for a, b in zip(bounds, bounds[1:])) * element > _NODE_UNIT_BYTES:
        return None
    shape = (grad_out.shape[-1], inp.shape[-1])
    if tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous torch.float32 tensor of shape {shape}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if grad_out.dtype != inp.dtype or grad_out.dtype not in DTYPE_CODES:
        grad_out, inp = grad_out.float(), inp.float()
    copies = _Copies()
    try:
        a = _rows_contiguous(grad_out.transpose(-1, -2), copies)
        b = _rows_contiguous(inp.transpose(-1, -2), copies)
        n, k = shape
        rows = a.shape[-1]
        offsets = torch.tensor(bounds, dtype=torch.int64)
        status = library().ls_gemm_nt_tree(
            n, k, rows, a.data_ptr(), a.stride(0) if n > 1 else rows, b.data_ptr(), b.stride(0) if k > 1 else rows,
            out.data_ptr(), k, len(bounds) - 1, offsets.data_ptr(), DTYPE_CODES[a.dtype], isa(),
            torch.get_num_threads())
    finally:
        copies.close()
    if status != 0:
        raise RuntimeError(f"ls_gemm_nt_tree refused a [{n}, {rows}] x [{k}, {rows}] {a.dtype} product in units "
                           f"{bounds[:8]}")
    return out
