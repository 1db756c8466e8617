"""Shared pieces of the Triton backend: launch helpers and the fixed tile configuration.

Every kernel takes sizes as runtime arguments and marks them do_not_specialize, so Triton compiles
one variant per (kernel, dtype, tile config) and never one per batch size (CONTRACT.md section 6).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# One tile configuration per dtype; none depends on M.
GEMM_TILES = {torch.float32: (32, 32, 32), torch.bfloat16: (64, 64, 32), torch.float16: (64, 64, 32),
              torch.float64: (32, 32, 16)}
ROW_BLOCK = 1024          # lanes per step of a row reduction
ROWS_PER_PARTIAL = 64     # rows per partial sum in two-pass weight-gradient reductions


def gemm_tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    return GEMM_TILES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 GEMMs in full IEEE precision (no TF32: the contract's fp32 tolerance is 1e-4).

    Under the interpreter, 16-bit operands are upcast first ("upcast"): Triton 3.9's interpreter
    computes bf16 tl.dot wrongly, and a bf16 or fp16 product is exact in fp32, so the upcast dot is
    what the GPU's fp32-accumulating MMA computes."""
    if dtype in (torch.float32, torch.float64):
        return "ieee"
    return "upcast" if INTERPRET else "tf32"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """tl.dot with fp32 accumulation; PRECISION "upcast" multiplies 16-bit operands in fp32."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def cast_out(x, ptr):
    """x converted to the element type of `ptr`, rounding to nearest even. For bf16 the rounding is
    done on the bits: Triton's interpreter truncates fp32 -> bf16, and on a GPU this computes what
    the hardware conversion does."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(ptr.dtype.element_ty)


@triton.jit
def dot_mixed(a, b, PRECISION: tl.constexpr):
    """a (fp32, e.g. probabilities) @ b: a is cast to b's dtype for the tensor-core dot; under
    "upcast" both are multiplied in fp32."""
    if PRECISION == "upcast":
        return tl.dot(a, b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b, input_precision=PRECISION)
