"""The mode's kernels on the Triton backend, the route CUDA tensors take (`routes`, docs/adr/0039):
the GEMM family on the backend's one GEMM (`backends/triton/gemm.py`), log_softmax and softmax on
its log_softmax kernels, RMSNorm on its rms_norm kernels. Where the mode and the backend's op compute
the same thing, they give the same bits: a linear layer without bias and ops.linear, log_softmax
and ops.log_softmax (the backward too in fp32), RMSNorm and ops.rms_norm, SDPA and
ops.masked_attention. softmax's backward, the sums, means and activations, and float64 take the CPU
route's kernels, which on a GPU run PyTorch's elementwise ops and fixed-order sums."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ..backends.triton import gemm as triton_gemm
from ..backends.triton import log_softmax as triton_log_softmax
from ..backends.triton import rms_norm as triton_rms_norm
from ..backends.triton.common import lane_block, launch
from ..backends.triton.reduce import column_sum
from .kernels import default_rms_eps, gemm_overrides, out_variant

# The dtypes the Triton backend takes (contract.toml [backends.triton]).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] @ b [K, N], or batched a [B, M, K] @ b [B, K, N] (one launch per batch entry), on
    the Triton backend's GEMM: every output tile reduces the whole K in order, whatever M. In a's
    dtype."""
    if a.dim() == 3:
        out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
        for i in range(a.shape[0]):
            out[i] = matmul(a[i], b[i])
        return out
    if a.shape[0] == 0 or b.shape[1] == 0:
        return a.new_zeros((a.shape[0], b.shape[1]))
    return triton_gemm.gemm(a, b)


def _rows(x: Tensor, dim: int) -> Tensor:
    """x with `dim` moved last and flattened to contiguous rows [R, V]."""
    y = x.movedim(dim, -1).contiguous()
    return y.reshape(-1, y.shape[-1])


def _log_softmax_rows(x: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Rows [R, V] -> x - logsumexp(x) per row in out_dtype, by ops.log_softmax's kernel."""
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    launch(triton_log_softmax.log_softmax_fwd_kernel, x.shape[0], x, y, lse, x.shape[1], BLOCK=lane_block(x.shape[1]))
    return y


def _log_softmax(self, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else self.dtype
    moved = self.movedim(dim, -1)
    return _log_softmax_rows(_rows(self, dim), out_dtype).reshape(moved.shape).movedim(-1, dim)


def _log_softmax_backward(grad_output, output, dim, input_dtype):
    """dx = g - exp(y) * sum(g), by ops.log_softmax's backward kernel given the output y and a zero
    log-sum-exp: in fp32 y is the kernel's own x - lse, so the bits are the op's."""
    g, y = _rows(grad_output, dim), _rows(output, dim)
    dx = torch.empty(g.shape, dtype=input_dtype, device=g.device)
    lse = torch.zeros(g.shape[0], dtype=torch.float32, device=g.device)
    launch(triton_log_softmax.log_softmax_bwd_kernel, g.shape[0], y, lse, g, dx, g.shape[1],
           BLOCK=lane_block(g.shape[1]))
    return dx.reshape(grad_output.movedim(dim, -1).shape).movedim(-1, dim)


def _softmax(self, dim, half_to_float):
    """exp of the fp32 log_softmax rows, rounded once to the output dtype."""
    out_dtype = torch.float32 if half_to_float else self.dtype
    moved = self.movedim(dim, -1)
    y = torch.exp(_log_softmax_rows(_rows(self, dim), torch.float32))
    return y.to(out_dtype).reshape(moved.shape).movedim(-1, dim)


def _norm_weight(weight: Tensor | None, n: int, x: Tensor) -> tuple[Tensor, float]:
    """The kernels' (w, offset), whose w + offset is the scale: (weight, 0), or (zeros, 1) without one."""
    if weight is None:
        return torch.zeros(n, dtype=x.dtype, device=x.device), 1.0
    return weight.reshape(-1).contiguous(), 0.0


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    n = math.prod(normalized_shape)
    x = input.reshape(-1, n).contiguous()
    eps = default_rms_eps(x.dtype) if eps is None else eps
    w, offset = _norm_weight(weight, n, x)
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    launch(triton_rms_norm.rms_norm_fwd_kernel, x.shape[0], x, w, y, rstd, n, eps, offset, BLOCK=lane_block(n))
    stat_shape = list(input.shape[: input.dim() - len(normalized_shape)]) + [1] * len(normalized_shape)
    return y.reshape(input.shape), rstd.reshape(stat_shape)


def _rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    n = math.prod(normalized_shape)
    x, g = input.reshape(-1, n).contiguous(), grad_out.reshape(-1, n).contiguous()
    w, offset = _norm_weight(weight, n, x)
    dx = torch.empty_like(x)
    gxhat = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    launch(triton_rms_norm.rms_norm_bwd_kernel, x.shape[0], x, w, g, rstd.reshape(-1).float().contiguous(), dx, gxhat,
           n, offset, BLOCK=lane_block(n))
    dw = None
    if output_mask[1] and weight is not None:
        dw = column_sum(gxhat).to(weight.dtype).reshape(weight.shape)
    return (dx.reshape(input.shape) if output_mask[0] else None), dw


def _on_triton(fn: Callable, cpu_fn: Callable | None) -> Callable:
    """fn where the call's first floating-point tensor has a dtype Triton takes (and is not a
    scalar), else the CPU route's kernel (None: the stock kernel)."""
    def kernel(*args, **kwargs):
        first = next((a for a in args if isinstance(a, Tensor) and a.is_floating_point()), None)
        if first is not None and first.dtype in DTYPES and first.dim() > 0:
            return fn(*args, **kwargs)
        return cpu_fn(*args, **kwargs) if cpu_fn is not None else None
    kernel.__name__ = getattr(fn, "__name__", "kernel")
    return kernel


def overrides(cpu: dict[str, Callable]) -> dict[str, Callable]:
    """The Triton route's kernels for the aten ops of the CPU route's table `cpu`: the same names,
    the Triton kernels where this module has them, the CPU route's elsewhere."""
    own = {
        **gemm_overrides(matmul),
        "_log_softmax": _log_softmax,
        "_log_softmax_backward_data": _log_softmax_backward,
        "_softmax": _softmax,
        "_fused_rms_norm": _rms_norm,
        "_fused_rms_norm_backward": _rms_norm_backward,
    }
    own["_log_softmax.out"] = out_variant(_log_softmax)
    own["_softmax.out"] = out_variant(_softmax)
    return {name: (_on_triton(own[name], fn) if name in own else fn) for name, fn in cpu.items()}
