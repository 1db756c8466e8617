"""Triton rms_norm: one program per row; dweight by a fixed two-pass column sum. Its `add` form
(`add_forward`) takes a decoder layer's residual add before the norm in the same launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics import grad_tree
from ...numerics.fixed_order import accumulate_dtype
from ...registry import register
from ...numerics.second_order import first_order_only
from .common import cast_out, lane_block
from .reduce import column_sum


@triton.jit(do_not_specialize=["H", "eps", "offset"])
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, offset, BLOCK: tl.constexpr):
    """Program r normalises row r: sum of squares in BLOCK-lane steps, then y = x * rstd * (offset + w)."""
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        x = tl.load(x_ptr + row * H + h0 + lanes, mask=h0 + lanes < H, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    tl.store(rstd_ptr + row, rstd)
    for h0 in range(0, H, BLOCK):
        m = h0 + lanes < H
        x = tl.load(x_ptr + row * H + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * H + h0 + lanes, cast_out(((x * rstd) * (w + offset)), y_ptr), mask=m)


@triton.jit(do_not_specialize=["H", "eps", "offset"])
def add_rms_norm_fwd_kernel(r_ptr, d_ptr, w_ptr, sum_ptr, y_ptr, H, eps, offset, BLOCK: tl.constexpr):
    """Program r: s = residual + delta of row r, widened exactly, added in fp32 and rounded to the
    dtype as ATen's add is, stored; then rms_norm_fwd_kernel's operations on s. The second pass
    recomputes s rather than reading back what this program stored."""
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        m = h0 + lanes < H
        a = tl.load(r_ptr + row * H + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        b = tl.load(d_ptr + row * H + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        s = cast_out(a + b, sum_ptr)
        tl.store(sum_ptr + row * H + h0 + lanes, s, mask=m)
        x = s.to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    for h0 in range(0, H, BLOCK):
        m = h0 + lanes < H
        a = tl.load(r_ptr + row * H + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        b = tl.load(d_ptr + row * H + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        x = cast_out(a + b, sum_ptr).to(tl.float32)
        w = tl.load(w_ptr + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * H + h0 + lanes, cast_out(((x * rstd) * (w + offset)), y_ptr), mask=m)


@triton.jit(do_not_specialize=["H", "offset"])
def rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, gxhat_ptr, H, offset, BLOCK: tl.constexpr):
    """Program r: dx of row r, and g * xhat of row r (the rows that dweight sums)."""
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    rstd = tl.load(rstd_ptr + row)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        m = h0 + lanes < H
        x = tl.load(x_ptr + row * H + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * H + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        acc += (g * (w + offset)) * (x * rstd)
    dot = tl.sum(acc, axis=0) / H
    for h0 in range(0, H, BLOCK):
        m = h0 + lanes < H
        x = tl.load(x_ptr + row * H + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * H + h0 + lanes, mask=m, other=0.0).to(tl.float32)
        xhat = x * rstd
        tl.store(dx_ptr + row * H + h0 + lanes, cast_out((rstd * (g * (w + offset) - xhat * dot)), dx_ptr),
                 mask=m)
        tl.store(gxhat_ptr + row * H + h0 + lanes, g * xhat, mask=m)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        m, h = x.shape
        y = torch.empty_like(x)
        rstd = torch.empty(m, dtype=accumulate_dtype(x.dtype), device=x.device)
        if m:
            rms_norm_fwd_kernel[(m,)](x, weight, y, rstd, h, eps, offset, BLOCK=lane_block(h))
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        ctx.use = grad_tree.capture("rms_norm", weight, m, ctx.needs_input_grad[1])
        return y

    @staticmethod
    @first_order_only("rms_norm")
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        m, h = x.shape
        g = g.contiguous()
        dx = torch.empty_like(x)
        gxhat = torch.empty((m, h), dtype=accumulate_dtype(x.dtype), device=x.device)
        if m:
            rms_norm_bwd_kernel[(m,)](x, weight, g, rstd, dx, gxhat, h, ctx.offset,
                                      BLOCK=lane_block(h))
        per_token = ctx.use.per_token if ctx.use is not None else 1

        def partial(start, stop):
            # Inside a unit tree, the rows of one token (heads) stay apart: grad_tree.combine reduces them last.
            if per_token == 1:
                return column_sum(gxhat[start:stop])
            return column_sum(gxhat[start:stop].reshape(-1, per_token * h)).view(per_token, h)

        dw = grad_tree.per_unit(ctx.use, m, partial)
        return dx, (None if dw is None else dw.to(weight.dtype)), None, None


@register("triton", "rms_norm")
def rms_norm(x, weight, eps, offset):
    return _RMSNorm.apply(x.contiguous(), weight.contiguous(), eps, offset)


def add_forward(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, rms_norm of that sum), both [rows, H] in residual's dtype, from residual
    and delta [rows, H] of that dtype (fp32, bf16 or fp16): one launch, with the bits of ATen's add
    and this backend's rms_norm. The forward alone: for callers that record no graph."""
    residual, delta = residual.contiguous(), delta.contiguous()
    m, h = residual.shape
    total, y = torch.empty_like(residual), torch.empty_like(residual)
    if m:
        add_rms_norm_fwd_kernel[(m,)](residual, delta, weight.contiguous(), total, y, h, eps, offset,
                                      BLOCK=lane_block(h))
    return total, y


# ops.add_rms_norm's form of this backend (docs/adr/0042): a residual add and the next RMSNorm in one launch.
rms_norm.add = add_forward
