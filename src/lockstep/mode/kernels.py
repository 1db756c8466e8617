"""The mode's kernels for the GEMM family, sums and means, the softmax family, RMSNorm and the
activations: each computes what its aten op computes, on lockstep's fixed-order primitives, and
shares its arithmetic with the portable backend where the backend has the op (log_softmax's
shifted log-sum-exp, rms_norm's inverse RMS). Their GEMMs, exp, log and sqrt run on the CPU
backend's kernels (`registry.cpu_backend_kernel_set`): native where it builds, whose bits do not
follow MKL's blocking (docs/adr/0010). `OVERRIDES` maps aten op names to them."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from .. import registry
from ..backends.portable.gelu_mul import gelu_tanh, gelu_tanh_derivative
from ..backends.portable.rms_norm import inverse_rms
from ..numerics.cpu_kernels import CpuKernels
from ..numerics.fixed_order import (accumulate_dtype, column_sum, exp, log_softmax_rows, log_softmax_rows_backward,
                                    matmul_rows, row_sum, silu, silu_backward)
from ..numerics.softcap import softcap
from . import state


def _kernels() -> CpuKernels | None:
    """The kernels every override runs on: the CPU backend's, for the process (the registry's)."""
    return registry.cpu_backend_kernel_set()


def _rows_last(x: Tensor, dims: list[int]) -> tuple[Tensor, list[int]]:
    """Move `dims` to the end and flatten them: [rows..., R] contiguous."""
    nd = x.dim()
    dims = sorted({d % nd for d in dims}) if dims else list(range(nd))
    keep = [d for d in range(nd) if d not in dims]
    y = x.permute(keep + dims).contiguous()
    return y.reshape([x.shape[d] for d in keep] + [-1]), dims


def _restore(y: Tensor, x_shape: list[int], dims: list[int], keepdim: bool) -> Tensor:
    if keepdim:
        shape = [1 if d in dims else s for d, s in enumerate(x_shape)]
        return y.reshape(shape)
    return y


# The GEMM family. Every variant rounds the product to the output dtype first and adds the rest
# after, exactly as PyTorch's own bmm + add does: so a linear layer gives the same bits whether
# PyTorch runs it as addmm (contiguous input) or as bmm + add (a strided 3-D input).
def _scale_add(prod: Tensor, c: Tensor, beta, alpha) -> Tensor:
    """alpha * prod + beta * c in the accumulation dtype, rounded once to prod's dtype."""
    acc = accumulate_dtype(prod.dtype)
    out = prod.to(acc) * alpha if alpha != 1 else prod.to(acc)
    if beta != 0:
        out = out + (c.to(acc) * beta if beta != 1 else c.to(acc))
    return out.to(prod.dtype)


def gemm_overrides(matmul: Callable[[Tensor, Tensor], Tensor]) -> dict[str, Callable]:
    """The GEMM family's kernels (mm, addmm, bmm, ..., their out= and in-place forms, _grouped_mm) on
    one row-invariant product `matmul(a, b)`: a [M, K] @ b [K, N], or batched a [B, M, K] @ b [B, K, N],
    in a's dtype. The CPU route passes `matmul_rows` on the CPU backend's kernels, the Triton route
    the Triton backend's GEMM."""

    def mm(self, mat2):
        return matmul(self, mat2)

    def grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
        """The mixture-of-experts form: rows [S, K] in groups ending at offs [G], weights [G, K, N] ->
        [S, N], each group's rows on the fixed row tiles of its own weight. Other forms run stock."""
        if offs is None or self.dim() != 2 or mat2.dim() != 3 or bias is not None:
            if state.strict:
                raise RuntimeError("lockstep.batch_invariant(strict=True): aten::_grouped_mm is covered for 2-D rows "
                                   "against 3-D weights with offs (the experts' forward); this form (its backward's "
                                   "weight gradient, say) has no batch-invariant implementation in lockstep")
            return None
        dtype = out_dtype or self.dtype
        out = self.new_zeros((self.shape[0], mat2.shape[2]), dtype=dtype)
        start = 0
        for g, stop in enumerate(offs.tolist()):
            if stop > start:
                out[start:stop] = matmul(self[start:stop], mat2[g]).to(dtype)
            start = stop
        return out

    def addmm(self, mat1, mat2, beta=1, alpha=1):
        return _scale_add(matmul(mat1, mat2), self, beta, alpha)

    def baddbmm(self, batch1, batch2, beta=1, alpha=1):
        return _scale_add(matmul(batch1, batch2), self, beta, alpha)

    def addbmm(self, batch1, batch2, beta=1, alpha=1):
        products = matmul(batch1, batch2).to(accumulate_dtype(batch1.dtype))
        total = products[0]
        for b in range(1, products.shape[0]):         # the batch entries in order
            total = total + products[b]
        return _scale_add(total.to(batch1.dtype), self, beta, alpha)

    def mv(self, vec):
        """A matrix-vector product as a one-column GEMM on fixed row tiles: row i has the bits of row i
        of the same matrix times any other matrix column (no GEMV path)."""
        return matmul(self, vec[:, None])[:, 0]

    def addmv(self, mat, vec, beta=1, alpha=1):
        return _scale_add(mv(mat, vec), self, beta, alpha)

    def dot(self, tensor):
        if self.is_complex():
            return None
        return matmul(self[None], tensor[:, None])[0, 0]

    gemms = {"mm": mm, "addmm": addmm, "bmm": mm, "baddbmm": baddbmm, "addbmm": addbmm, "mv": mv, "addmv": addmv,
             "dot": dot, "vdot": dot}
    return {
        **gemms,
        **{f"{name}.out": out_variant(fn) for name, fn in gemms.items()},
        **{f"{name}_": _inplace_variant(fn) for name, fn in gemms.items()
           if name.startswith("add") or name == "baddbmm"},
        "_grouped_mm": grouped_mm,
    }


def out_variant(fn):
    """fn's result written into `out` (resized as PyTorch's out= variants do)."""
    def out_kernel(*args, out, **kwargs):
        result = fn(*args, **kwargs)
        if result is None:
            return None
        if out.shape != result.shape:
            out.resize_(result.shape)
        return out.copy_(result)
    return out_kernel


def _inplace_variant(fn):
    """fn's result written into its first argument (addmm_, baddbmm_, ...)."""
    def inplace_kernel(self, *args, **kwargs):
        result = fn(self, *args, **kwargs)
        return None if result is None else self.copy_(result)
    return inplace_kernel


def _sum_all(self, dtype=None):
    x = self if dtype is None else self.to(dtype)
    if not x.is_floating_point():
        return None
    return row_sum(x.reshape(1, -1).to(accumulate_dtype(x.dtype)), kernels=_kernels())[0].to(x.dtype)


def _mean_all(self, dtype=None):
    x = self if dtype is None else self.to(dtype)
    total = row_sum(x.reshape(1, -1).to(accumulate_dtype(x.dtype)), kernels=_kernels())[0]
    return (total / max(1, x.numel())).to(x.dtype)


def _sum(self, dim=None, keepdim=False, dtype=None):
    x = self if dtype is None else self.to(dtype)
    if not x.is_floating_point():
        return None                                   # integer sums are exact in any order: run stock
    rows, dims = _rows_last(x, list(dim) if dim else [])
    out = row_sum(rows.to(accumulate_dtype(x.dtype)), kernels=_kernels()).to(x.dtype)
    return _restore(out, list(x.shape), dims, keepdim)


def _mean(self, dim=None, keepdim=False, dtype=None):
    x = self if dtype is None else self.to(dtype)
    rows, dims = _rows_last(x, list(dim) if dim else [])
    n = rows.shape[-1]
    out = (row_sum(rows.to(accumulate_dtype(x.dtype)), kernels=_kernels()) / n).to(x.dtype)
    return _restore(out, list(x.shape), dims, keepdim)


def _last(x: Tensor, dim: int) -> Tensor:
    return x.movedim(dim, -1).contiguous()


def _log_softmax(self, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else self.dtype
    x = _last(self, dim)
    xf = x.to(accumulate_dtype(x.dtype))
    y = log_softmax_rows(xf.reshape(-1, xf.shape[-1] if xf.dim() else 1), kernels=_kernels()).reshape(xf.shape)
    return y.to(out_dtype).movedim(-1, dim)


def _log_softmax_backward(grad_output, output, dim, input_dtype):
    g = _last(grad_output, dim)
    acc = accumulate_dtype(g.dtype)
    gf, yf = g.to(acc), _last(output, dim).to(acc)
    n = gf.shape[-1] if gf.dim() else 1
    dx = log_softmax_rows_backward(gf.reshape(-1, n), yf.reshape(-1, n), kernels=_kernels()).reshape(gf.shape)
    return dx.to(input_dtype).movedim(-1, dim)


def _softmax(self, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else self.dtype
    x = _last(self, dim)
    xf = x.to(accumulate_dtype(x.dtype))
    e = exp(xf - torch.amax(xf, dim=-1, keepdim=True), kernels=_kernels())
    return (e / row_sum(e, kernels=_kernels())[..., None]).to(out_dtype).movedim(-1, dim)


def _softmax_backward(grad_output, output, dim, input_dtype):
    g = _last(grad_output, dim)
    acc = accumulate_dtype(g.dtype)
    gf, yf = g.to(acc), _last(output, dim).to(acc)
    return (yf * (gf - row_sum(gf * yf, kernels=_kernels())[..., None])).to(input_dtype).movedim(-1, dim)


def default_rms_eps(dtype: torch.dtype) -> float:
    """The eps PyTorch's rms_norm takes when given None: that of the dtype it computes in (float32
    for 16-bit inputs), not the input's."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    n = math.prod(normalized_shape)
    x = input.reshape(-1, n)
    acc = accumulate_dtype(x.dtype)
    eps = default_rms_eps(x.dtype) if eps is None else eps
    xf = x.to(acc)
    rstd = inverse_rms(xf, eps, kernels=_kernels())
    y = xf * rstd[:, None]
    if weight is not None:
        y = y * weight.reshape(-1).to(acc)
    stat_shape = list(input.shape[: input.dim() - len(normalized_shape)]) + [1] * len(normalized_shape)
    return y.to(input.dtype).reshape(input.shape), rstd.reshape(stat_shape)


def _rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    n = math.prod(normalized_shape)
    x, g = input.reshape(-1, n), grad_out.reshape(-1, n)
    acc = accumulate_dtype(x.dtype)
    r = rstd.reshape(-1, 1).to(acc)
    xhat = x.to(acc) * r
    gf = g.to(acc)
    gw = gf * weight.reshape(-1).to(acc) if weight is not None else gf
    dx = dw = None
    if output_mask[0]:
        dot = row_sum(gw * xhat, kernels=_kernels()) / n
        dx = (r * (gw - xhat * dot[:, None])).to(input.dtype).reshape(input.shape)
    if output_mask[1] and weight is not None:
        dw = column_sum(gf * xhat).to(weight.dtype).reshape(weight.shape)
    return dx, dw


def _silu(self):
    return silu(self, kernels=_kernels())


def _silu_backward(grad_output, self):
    return silu_backward(grad_output, self, kernels=_kernels())


def _erf_gelu_runs_stock() -> None:
    if state.strict:
        raise RuntimeError("lockstep.batch_invariant(strict=True): aten::gelu with approximate='none' (the erf "
                           "form) has no batch-invariant implementation in lockstep; approximate='tanh' has")
    return None


def _gelu(self, approximate="none"):
    if approximate != "tanh":
        return _erf_gelu_runs_stock()
    acc = accumulate_dtype(self.dtype)
    return gelu_tanh(self.to(acc), kernels=_kernels())[1].to(self.dtype)


def _gelu_backward(grad_output, self, approximate="none"):
    if approximate != "tanh":
        return _erf_gelu_runs_stock()
    acc = accumulate_dtype(self.dtype)
    g = self.to(acc)
    s, gelu = gelu_tanh(g, kernels=_kernels())
    return (grad_output.to(acc) * gelu_tanh_derivative(g, s, gelu, kernels=_kernels())).to(self.dtype)


def _tanh(self):
    acc = accumulate_dtype(self.dtype)
    return softcap(self.to(acc), 1.0, kernels=_kernels())[0].to(self.dtype)   # 1 * tanh(x / 1), lockstep's one tanh


def _tanh_backward(grad_output, output):
    acc = accumulate_dtype(output.dtype)
    y = output.to(acc)
    return (grad_output.to(acc) * (1.0 - y * y)).to(output.dtype)


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    return matmul_rows(a, b, kernels=_kernels())


OVERRIDES = {
    **gemm_overrides(_matmul),
    "sum.default": _sum_all,
    "sum.dim_IntList": _sum,
    "sum.IntList_out": out_variant(_sum),
    "mean.default": _mean_all,
    "mean.dim": _mean,
    "mean.out": out_variant(_mean),
    "_log_softmax": _log_softmax,
    "_log_softmax.out": out_variant(_log_softmax),
    "_log_softmax_backward_data": _log_softmax_backward,
    "_softmax": _softmax,
    "_softmax.out": out_variant(_softmax),
    "_softmax_backward_data": _softmax_backward,
    "silu": _silu,
    "silu_backward": _silu_backward,
    "gelu": _gelu,
    "tanh": _tanh,
    "tanh_backward": _tanh_backward,
    "gelu_backward": _gelu_backward,
    "_fused_rms_norm": _rms_norm,
    "_fused_rms_norm_backward": _rms_norm_backward,
}
