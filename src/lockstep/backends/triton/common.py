"""Shared pieces of the Triton backend: launch helpers and the fixed tile configuration.

Every kernel takes sizes as runtime arguments and marks them do_not_specialize, so Triton compiles
one variant per (kernel, dtype, tile config) and never one per batch size (docs/contract.md, section 6).
The GEMM's strides are specialized (ADR 0014): they follow the layout and the feature sizes.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from ...numerics.second_order import first_order_only

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# One GEMM configuration per dtype and GPU architecture; none depends on M. The Hopper (sm_90)
# entries were chosen from `lockstep gpu-audit`'s figures (docs/gpu.md): wgmma works on a warpgroup
# tile of 64 x N, and 64 x 128 x 64 keeps 238 registers and no spills where 128 x 128 reaches 255.
# A 128 x 128 x 64 tile with 8 warps wins at large M and loses at M = 1 (benchmarks/bench_gemm_tiles.py,
# docs/gpu.md), so the default stays until the engine, which decodes at small M, is measured with it.
# BLOCK_K fixes the order of each output's sum, so another architecture may give other bits
# (docs/contract.md, section 7).
GEMM_CONFIGS = {
    None: {torch.float32: GemmConfig(32, 32, 32), torch.bfloat16: GemmConfig(64, 64, 32),
           torch.float16: GemmConfig(64, 64, 32), torch.float64: GemmConfig(32, 32, 16)},
    90: {torch.float32: GemmConfig(64, 64, 16), torch.bfloat16: GemmConfig(64, 128, 64),
         torch.float16: GemmConfig(64, 128, 64), torch.float64: GemmConfig(32, 32, 16)},
}
LANE_BLOCK = 1024         # lanes per step of a row reduction (at most; fewer for short rows)
ROWS_PER_PARTIAL = 64     # rows per partial sum in two-pass weight-gradient reductions


def gpu_capability() -> int | None:
    """The compute capability (80, 90, ...) of the target that Triton compiles for; None under
    the interpreter. `lockstep gpu-audit` sets the target without a GPU."""
    if INTERPRET:
        return None
    return triton.runtime.driver.active.get_current_target().arch


def gemm_config(dtype: torch.dtype) -> GemmConfig:
    """The GEMM tile configuration of `dtype` on the current architecture (GEMM_CONFIGS)."""
    return GEMM_CONFIGS.get(gpu_capability(), GEMM_CONFIGS[None])[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """How `dot` multiplies tiles of `dtype`.

    On a GPU: fp32 (and fp64) in full IEEE precision, never TF32 (the contract's fp32 tolerance is
    1e-4); 16-bit operands on the tensor cores with fp32 accumulation.

    Under the interpreter: "fixed", a product whose every output element is summed by the same
    fixed tree over K, whatever its row or column in the tile (see `fixed_order_dot`).
    """
    if INTERPRET:
        return "fixed"
    if dtype in (torch.float32, torch.float64):
        return "ieee"
    return "tf32"


def lane_block(v: int) -> int:
    """Lanes per step of a row reduction over v columns: a power of two, at most LANE_BLOCK."""
    return min(LANE_BLOCK, triton.next_power_of_2(v))


@triton.jit
def fixed_order_dot(a, b):
    """a [M, K] @ b [K, N] in fp32 (fp64 for fp64 inputs), for the interpreter: every product
    a[i, k] * b[k, j] is rounded once, and each output element sums its K products by the same tree
    (numpy's pairwise sum over a contiguous last axis), which depends on K alone.

    The interpreter's own tl.dot calls numpy's matmul, and with it the BLAS kernel that OpenBLAS picks
    for the CPU. Its Haswell and Zen kernels give an output element other bits at another row or
    column of the tile, which a GPU never does: the stand-in would then fail an invariant kernel.
    16-bit products are exact in fp32, so upcasting first equals an fp32-accumulating MMA up to the
    summation order (docs/adr/0004-triton-backend.md)."""
    if a.dtype == tl.float64:
        return tl.sum(a[:, None, :] * tl.trans(b)[None, :, :], axis=2)
    else:
        return tl.sum(a.to(tl.float32)[:, None, :] * tl.trans(b.to(tl.float32))[None, :, :], axis=2)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation (see `dot_precision`)."""
    if PRECISION == "fixed":
        return fixed_order_dot(a, b)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def dot_acc(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b, the same order for every output element.

    16-bit operands: the MMA accumulates into acc. fp32 ("ieee", FMA on a GPU): the tile's product
    starts from zero and is then added, so a K-long reduction is a sum of BLOCK_K-long partial sums;
    accumulating into acc would chain all K products in one running sum, whose error grows with K
    (measured on an H200: 2.3x cuBLAS's error on a 1,100-long reduction, docs/gpu.md). Under the
    interpreter the tile product is summed by `fixed_order_dot` and then added."""
    if PRECISION == "fixed":
        return acc + fixed_order_dot(a, b)
    elif PRECISION == "ieee":
        # Triton's combine pass folds `acc + dot(a, b)` back into `dot(a, b, acc)`, except for a dot
        # whose max_num_imprecise_acc is not 0. That field only means something for fp8 MMA; on
        # an fp32 FMA dot it only keeps the two sums apart (docs/adr/0013).
        return acc + tl.dot(a, b, input_precision=PRECISION, max_num_imprecise_acc=1)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def round_bf16(x):
    """fp32 -> bf16, rounding to nearest even on the bits: what the GPU's conversion does. Triton's
    interpreter truncates instead."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_out(x, ptr):
    """x converted to the element type of `ptr`, rounding to nearest even."""
    if ptr.dtype.element_ty == tl.bfloat16:
        return round_bf16(x)
    else:
        return x.to(ptr.dtype.element_ty)


@triton.jit
def dot_mixed(a, b, PRECISION: tl.constexpr):
    """a (fp32, e.g. probabilities) @ b, with a first rounded to b's dtype as the tensor-core dot
    needs; under the interpreter the rounded operands are multiplied by `fixed_order_dot`."""
    if PRECISION == "fixed":
        if b.dtype == tl.bfloat16:
            return fixed_order_dot(round_bf16(a), b)
        else:
            return fixed_order_dot(a.to(b.dtype), b)
    else:
        return tl.dot(a.to(b.dtype), b, input_precision=PRECISION)


@triton.jit
def row_lse(x_ptr, V, scale, BLOCK: tl.constexpr):
    """log-sum-exp of the V values at x_ptr (times scale), over BLOCK lanes from column 0: per lane a
    running max and a rescaled running sum, then the lanes combined by tl.max / tl.sum."""
    lanes = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + v0 + lanes, mask=v0 + lanes < V, other=float("-inf")).to(tl.float32) * scale
        new = tl.maximum(m, x)
        shift = tl.where(new == float("-inf"), 0.0, new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = new
    mx = tl.max(m, axis=0)
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    return mx + tl.log(tl.sum(s * tl.exp(m - shift), axis=0))


ELEMENTWISE_BLOCK = 1024


def launch(kernel, programs: int, *args, **constants) -> None:
    """Run `kernel` over a 1-D grid of `programs` programs, and nothing where there are none: an
    empty batch has no grid to launch."""
    if programs:
        kernel[(programs,)](*args, **constants)


def kernel_function(op: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd Function of one output from two launchers: `forward(*inputs)` returns (output,
    tensors to save) and `backward(saved, grad)` the inputs' gradients, grad the output's gradient
    made contiguous. A second derivative through it is refused under the name `op`
    (first_order_only)."""

    class KernelFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            out, saved = forward(*inputs)
            ctx.save_for_backward(*saved)
            return out

        @staticmethod
        @first_order_only(op)
        def backward(ctx, grad):
            return backward(ctx.saved_tensors, grad.contiguous())

    return KernelFunction


def gated_function(fwd_kernel, bwd_kernel, **constants) -> type[torch.autograd.Function]:
    """An autograd Function for a gated activation y = act(gate) * up whose Triton kernels take
    (gate, up, y, n) forward and (gate, up, dy, dgate, dup, n) backward, each program one block of
    ELEMENTWISE_BLOCK elements; `constants` are the kernels' other constexpr arguments."""

    def forward(gate, up):
        y = torch.empty_like(gate)
        n = gate.numel()
        launch(fwd_kernel, triton.cdiv(n, ELEMENTWISE_BLOCK), gate, up, y, n, BLOCK=ELEMENTWISE_BLOCK, **constants)
        return y, (gate, up)

    def backward(saved, dy):
        gate, up = saved
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        launch(bwd_kernel, triton.cdiv(n, ELEMENTWISE_BLOCK), gate, up, dy, dg, du, n, BLOCK=ELEMENTWISE_BLOCK,
               **constants)
        return dg, du

    return kernel_function("silu_mul / gelu_mul", forward, backward)
