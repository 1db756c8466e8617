"""Triton rope: one program per token rotates each head by that token's own angles (float64
position x frequency, from lockstep.rotary, as every backend). Its `into_cache` form
(`into_cache`) also writes a cached attention step's keys and values into the paged cache, in the
same launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics.fixed_order import accumulate_dtype
from ...registry import register
from ...rotary import rope_cos_sin
from ...numerics.second_order import first_order_only
from .common import cast_out


@triton.jit
def rotate_head(src_ptr, dst_ptr, c, s, i, m, HALF, GPTJ: tl.constexpr):
    """One head of 2 * HALF values at src_ptr rotated by c, s (fp32 [BLOCK] lanes i, mask m), stored
    at dst_ptr in dst_ptr's dtype."""
    if GPTJ:
        i1 = 2 * i
        i2 = 2 * i + 1
    else:
        i1 = i
        i2 = i + HALF
    x1 = tl.load(src_ptr + i1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + i2, mask=m, other=0.0).to(tl.float32)
    tl.store(dst_ptr + i1, cast_out((x1 * c - x2 * s), dst_ptr), mask=m)
    tl.store(dst_ptr + i2, cast_out((x2 * c + x1 * s), dst_ptr), mask=m)


@triton.jit(do_not_specialize=["H", "HALF"])
def rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, HALF, SIGN: tl.constexpr, GPTJ: tl.constexpr,
                BLOCK: tl.constexpr):
    """Program t rotates every head of token t by its own cos/sin row ([HALF] each)."""
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    c = tl.load(cos_ptr + t * HALF + i, mask=m, other=0.0)
    s = tl.load(sin_ptr + t * HALF + i, mask=m, other=0.0) * SIGN
    for h in range(0, H):
        base = (t * H + h) * 2 * HALF
        rotate_head(x_ptr + base, y_ptr + base, c, s, i, m, HALF, GPTJ)


@triton.jit(do_not_specialize=["HQ", "HKV", "HALF", "SLOTS"])
def rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, out_ptr, kc_ptr, vc_ptr, slot_ptr, HQ, HKV, HALF, SLOTS,
                   GPTJ: tl.constexpr, BLOCK: tl.constexpr):
    """Program t: token t's query heads rotated into out, its key heads rotated into the caches' slot
    slot[t] and its value heads copied there, with rope_kernel's arithmetic. The slots come checked
    (build_step); one outside [0, SLOTS) is not written, so that no other memory is."""
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    c = tl.load(cos_ptr + t * HALF + i, mask=m, other=0.0)
    s = tl.load(sin_ptr + t * HALF + i, mask=m, other=0.0) * 1.0
    for h in range(0, HQ):
        base = (t * HQ + h) * 2 * HALF
        rotate_head(q_ptr + base, out_ptr + base, c, s, i, m, HALF, GPTJ)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    lane_slot = slot + i * 0
    inside = m & (lane_slot >= 0) & (lane_slot < SLOTS)
    for h in range(0, HKV):
        src = (t * HKV + h) * 2 * HALF
        dst = (slot * HKV + h) * 2 * HALF
        rotate_head(k_ptr + src, kc_ptr + dst, c, s, i, inside, HALF, GPTJ)
        lo = tl.load(v_ptr + src + i, mask=m, other=0.0)
        hi = tl.load(v_ptr + src + HALF + i, mask=m, other=0.0)
        tl.store(vc_ptr + dst + i, lo, mask=inside)
        tl.store(vc_ptr + dst + HALF + i, hi, mask=inside)


def _rope_launch(x, cos, sin, sign, style):
    t, h, d = x.shape
    y = torch.empty_like(x)
    if t:
        rope_kernel[(t,)](x, cos, sin, y, h, d // 2, SIGN=sign, GPTJ=style == "gptj",
                          BLOCK=triton.next_power_of_2(d // 2))
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, theta, style, scaling):
        cos, sin = rope_cos_sin(positions, x.shape[-1], theta, scaling, accumulate_dtype(x.dtype))
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.style = style
        return _rope_launch(x, cos, sin, 1.0, style)

    @staticmethod
    @first_order_only("rope")
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rope_launch(g.contiguous(), cos, sin, -1.0, ctx.style), None, None, None, None


@register("triton", "rope")
def rope(x, positions, theta, style, scaling):
    return _Rope.apply(x.contiguous(), positions, theta, style, scaling)


def into_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor, positions, theta: float, style: str, scaling) -> torch.Tensor | None:
    """A cached attention step's rotation and cache write in one launch (`rope_kv_kernel`): q [T, Hq, D]
    rotated, returned; k [T, Hkv, D] rotated and v as it is, written into slots [T] (int64, distinct,
    in range: build_step's checked slots) of the paged caches [blocks, block_size, Hkv, D]. The bits
    of this op on q and k, then write_kv. None, having written nothing, where the operands do not
    fit the kernel (several dtypes or devices, a tensor not contiguous, shapes that do not fit
    together): the caller then rotates and writes."""
    tensors = (q, k, v, k_cache, v_cache)
    if not (all(t.dtype == q.dtype and t.device == q.device and t.is_contiguous() for t in tensors)
            and q.dim() == 3 and k.dim() == 3 and v.shape == k.shape and k_cache.dim() == 4
            and v_cache.shape == k_cache.shape and k.shape[1:] == k_cache.shape[2:] and q.shape[2] == k.shape[2]
            and slots.dtype == torch.int64 and slots.device == q.device and slots.dim() == 1
            and slots.is_contiguous() and q.shape[-1] > 0 and q.shape[-1] % 2 == 0
            and q.shape[0] == k.shape[0] == slots.numel()):
        return None
    t, heads, dim = q.shape
    cos, sin = rope_cos_sin(positions, dim, theta, scaling, accumulate_dtype(q.dtype))
    cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    out = torch.empty_like(q)
    if t:
        rope_kv_kernel[(t,)](q, k, v, cos, sin, out, k_cache, v_cache, slots, heads, k.shape[1], dim // 2,
                             k_cache.shape[0] * k_cache.shape[1], GPTJ=style == "gptj",
                             BLOCK=triton.next_power_of_2(dim // 2))
    return out


# ops.cached_attention's form of this backend (docs/adr/0042): the step's rotation and cache write in one launch.
rope.into_cache = into_cache
