"""Native rope: fp32 and bf16 in one C pass (rows.c, `ls_rope`), forward and backward, with the
portable op's angles (rotary.rope_cos_sin) and its operations element for element, so both
backends give the same bits (NaN compared as NaN); fp16, empty tensors and heads wider than 512
take the portable op."""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import register
from ...rotary import rope_cos_sin
from ..portable import rope as portable
from .build import isa, library
from .gemm import OUT_CODES

_MAX_HEAD_DIM = 512  # rows.c's ROW_BLOCK


def _check_angles(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """That cos and sin are fp32 [T, 1, D / 2] and contiguous for x [T, H, D]: one row per token."""
    half = (x.shape[0], 1, x.shape[2] // 2)
    if tuple(cos.shape) != half or tuple(sin.shape) != half or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"positions: expected one per token of x {tuple(x.shape)}, got angles {tuple(cos.shape)}")


def _rotate_in_c(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    """x [T, H, D] (contiguous) rotated by cos, sin fp32 [T, 1, D / 2] in one C pass; x's shape and
    dtype."""
    _check_angles(x, cos, sin)
    y = torch.empty_like(x)
    status = library().ls_rope(x.shape[0], x.shape[1], x.shape[2], x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                               y.data_ptr(), OUT_CODES[x.dtype], style != "neox", isa(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"ls_rope refused x {tuple(x.shape)} {x.dtype}")
    return y


def _forward(x: Tensor, positions: Tensor, theta: float, style: str, scaling) -> tuple[Tensor, Tensor, Tensor]:
    """The rotated x (contiguous) and the angles' cos and sin it was rotated by."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, scaling, torch.float32)
    return _rotate_in_c(x, cos, sin, style), cos, sin


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, positions: Tensor, theta: float, style: str, scaling) -> Tensor:
        y, cos, sin = _forward(x, positions, theta, style, scaling)
        ctx.save_for_backward(cos, sin)
        ctx.style = style
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        cos, sin = ctx.saved_tensors
        # The transpose of a rotation is the rotation by the opposite angle. Under create_graph the
        # portable op's PyTorch rotation (the same bits) keeps the gradient differentiable.
        g = grad_y.contiguous()
        if torch.is_grad_enabled() or g.dtype not in OUT_CODES:
            return portable._rotate(g.to(cos.dtype), cos, -sin, ctx.style).to(g.dtype), None, None, None, None
        return _rotate_in_c(g, cos, -sin, ctx.style), None, None, None, None


@register("native", "rope")
def rope(x: Tensor, positions: Tensor, theta: float, style: str, scaling) -> Tensor:
    if x.dtype in OUT_CODES and 0 < x.numel() and x.shape[-1] <= _MAX_HEAD_DIM:
        if not torch.is_grad_enabled():  # no graph to record (the engine's steps): the forward alone
            return _forward(x.contiguous(), positions, theta, style, scaling)[0]
        return _Rope.apply(x.contiguous(), positions, theta, style, scaling)
    return portable.rope(x, positions, theta, style, scaling)


def into_cache(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions,
               theta: float, style: str, scaling) -> Tensor | None:
    """A cached attention step's rotation and cache write in one C pass (`ls_rope_kv`): q [T, Hq, D]
    rotated, returned; k [T, Hkv, D] rotated and v as it is, written into slots [T] (int64, distinct)
    of the paged caches [blocks, block_size, Hkv, D]. The bits of this op on q and k, then write_kv.
    The slots' range is checked (by the kernel, which then writes nothing), their distinctness is
    the caller's promise (build_step checks it). None, having written nothing, where the pass does
    not take the operands (another dtype, a head over 512 wide, a tensor off the CPU or not
    contiguous, shapes that do not fit together): the caller then rotates and writes."""
    tensors = (q, k, v, k_cache, v_cache)
    if not (q.dtype in OUT_CODES and all(t.dtype == q.dtype and t.device.type == "cpu" and t.is_contiguous()
                                         for t in tensors)
            and q.dim() == 3 and k.dim() == 3 and v.shape == k.shape and k_cache.dim() == 4
            and v_cache.shape == k_cache.shape and k.shape[1:] == k_cache.shape[2:] and q.shape[2] == k.shape[2]
            and slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.is_contiguous()
            and 0 < q.shape[-1] <= _MAX_HEAD_DIM and q.shape[-1] % 2 == 0
            and q.shape[0] == k.shape[0] == slots.numel() and slots.dim() == 1):
        return None
    cos, sin = (a.contiguous() for a in rope_cos_sin(positions, q.shape[-1], theta, scaling, torch.float32))
    _check_angles(q, cos, sin)
    out = torch.empty_like(q)
    t, heads, dim = q.shape
    status = library().ls_rope_kv(t, heads, k.shape[1], dim, q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(),
                                  sin.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                  slots.data_ptr(), k_cache.shape[0] * k_cache.shape[1], OUT_CODES[q.dtype],
                                  style != "neox", isa(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"ls_rope_kv refused q {tuple(q.shape)}, k {tuple(k.shape)} {q.dtype} into a cache "
                           f"{tuple(k_cache.shape)} at slots {slots.tolist()}")
    return out


# ops.cached_attention's form of this backend: the step's rotation and cache write in one call.
rope.into_cache = into_cache
