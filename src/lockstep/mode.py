"""Batch-invariant mode: route PyTorch's own operators to lockstep's kernels.

    with lockstep.batch_invariant():
        logits = hf_model(input_ids).logits       # now bitwise the same alone, batched or padded

`lockstep.batch_invariant`, `lockstep.enable` and `lockstep.disable` are this module's functions;
`lockstep.mode.unsupported()` and `lockstep.mode.coverage()` describe what it covers.

`enable()` registers overrides with torch.library on the CPU (and CUDA, when present) dispatch keys
of the aten ops in `COVERAGE`; `disable()` removes them, which restores the stock kernels. The
overrides run lockstep's portable kernels. Those call aten ops themselves (torch.mm on fixed
tiles, ...), so an override that is entered from inside a lockstep kernel calls the original
kernel, which it holds through torch.library.get_kernel.

The registrations are process-wide. One thread at a time may hold the mode (entering it from a
second thread raises); nesting in one thread is fine. Ops that lockstep cannot make invariant are
listed by `unsupported()`. They run unchanged, or raise on first use with `strict=True`.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator

import torch
from torch import Tensor

from .backends.portable import attention as portable_attention
from .backends.portable.gelu_mul import gelu_tanh, gelu_tanh_derivative
from . import registry
from .fixed_order import accumulate_dtype, column_sum, cpu_kernels, exp, log, matmul_rows, row_sum
from .softcap import softcap

_state = threading.local()
_lock = threading.Lock()
_owner: int | None = None
_depth = 0
_libs: list = []
_kernels = contextlib.ExitStack()   # the CPU kernels the mode selected, left on its exit
_strict = False

# (aten op, what lockstep does, dtypes). "+ out=, _" means the out= overload and the in-place form.
COVERAGE: list[tuple[str, str, str]] = [
    ("aten::mm (+ out=)", "fixed 128/8-row GEMM tiles (4-row in bf16 on CPU)", "fp32 bf16 fp16 fp64"),
    ("aten::addmm (+ out=, _)", "the product on fixed row tiles, rounded, then beta * self added", "fp32 bf16 fp16 fp64"),
    ("aten::bmm (+ out=)", "fixed row tiles per batch entry", "fp32 bf16 fp16 fp64"),
    ("aten::baddbmm (+ out=, _)", "as bmm, then beta * self added", "fp32 bf16 fp16 fp64"),
    ("aten::addbmm (+ out=, _)", "as bmm, the batch entries added in order", "fp32 bf16 fp16 fp64"),
    ("aten::_grouped_mm (2-D rows, 3-D weights, offs)", "each group's rows on fixed row tiles of its weight "
     "(transformers' grouped_mm experts); other forms run stock, strict=True raises", "fp32 bf16 fp16 fp64"),
    ("aten::mv, aten::addmv (+ out=, _)", "a one-column GEMM on fixed row tiles (no GEMV path)", "fp32 bf16 fp16 fp64"),
    ("aten::dot, aten::vdot (+ out=)", "a one-row GEMM (real dtypes)", "fp32 bf16 fp16 fp64"),
    ("aten::matmul / aten::linear", "decompose into the GEMMs above (3-D inputs, 1-D inputs, einsum, tensordot)",
     "fp32 bf16 fp16 fp64"),
    ("aten::_log_softmax (+ out=, backward)", "exact max, fixed-order row_sum", "fp32 bf16 fp16 fp64"),
    ("aten::_softmax (+ out=, backward)", "exact max, fixed-order row_sum", "fp32 bf16 fp16 fp64"),
    ("aten::softmax", "decomposes into _softmax", "fp32 bf16 fp16 fp64"),
    ("aten::silu (+ backward)", "1 / (1 + exp(-x)): the same bits in the vector body and the scalar tail",
     "fp32 bf16 fp16 fp64"),
    ("aten::gelu (+ backward), approximate='tanh'", "x * sigmoid(2u) from exp and a reciprocal (path-independent); "
     "the erf form runs stock (strict=True raises)", "fp32 bf16 fp16 fp64"),
    ("aten::tanh (+ backward)", "1 - 2 / (exp(2x) + 1): the same bits in the vector body and the scalar tail "
     "(Gemma's logit softcapping)", "fp32 bf16 fp16 fp64"),
    ("aten::sum (default, dim_IntList, out=)", "fixed-order row_sum (integer sums run stock: exact anyway)",
     "fp32 bf16 fp16 fp64"),
    ("aten::mean (default, dim, out=)", "fixed-order row_sum / n", "fp32 bf16 fp16 fp64"),
    ("aten::_fused_rms_norm (+ backward)", "lockstep rms_norm", "fp32 bf16 fp16 fp64"),
    ("aten::scaled_dot_product_attention", "via _scaled_dot_product_flash_attention_for_cpu (+ backward): "
     "fixed 64-key blocks anchored at each sequence's first visible key; causal, bool or 0/-inf "
     "float masks, GQA, decode", "fp32 bf16 fp16 fp64"),
]

# Float ops with a reduction whose order lockstep does not control. They run stock; with strict=True
# they raise on floating-point inputs (on integer ones they are exact, and run).
UNSUPPORTED = [
    "aten::var.correction", "aten::std.correction", "aten::var_mean.correction", "aten::std_mean.correction",
    "aten::native_layer_norm", "aten::native_group_norm", "aten::native_batch_norm", "aten::linalg_vector_norm",
    "aten::norm.ScalarOpt_dim", "aten::cumsum", "aten::cumprod", "aten::prod", "aten::prod.dim_int",
    "aten::logsumexp", "aten::nll_loss_forward", "aten::nll_loss2d_forward", "aten::embedding_dense_backward",
    "aten::index_add", "aten::scatter_add", "aten::_scaled_dot_product_attention_math", "aten::convolution",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
]


def unsupported() -> list[str]:
    """aten ops the mode cannot make batch-invariant; they run stock (or raise with strict=True)."""
    return list(UNSUPPORTED)


def coverage() -> list[dict]:
    devices = "CPU, CUDA" if torch.cuda.is_available() else "CPU (CUDA when present)"
    rows = [{"op": op, "how": how, "dtypes": dt, "devices": devices, "status": "invariant"} for op, how, dt in COVERAGE]
    rows += [{"op": op, "how": "not overridden", "dtypes": "-", "devices": "-", "status": "unsupported"}
             for op in UNSUPPORTED]
    return rows


def _inside() -> bool:
    return getattr(_state, "inside", 0) > 0


@contextlib.contextmanager
def _kernel() -> Iterator[None]:
    _state.inside = getattr(_state, "inside", 0) + 1
    try:
        yield
    finally:
        _state.inside -= 1


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


# --- the kernels ---------------------------------------------------------------------------------
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


def _mm(self, mat2):
    return matmul_rows(self, mat2)


def _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    """The mixture-of-experts form: rows [S, K] in groups ending at offs [G], weights [G, K, N] ->
    [S, N], each group's rows on the fixed row tiles of its own weight. Other forms run stock."""
    if offs is None or self.dim() != 2 or mat2.dim() != 3 or bias is not None:
        if _strict:
            raise RuntimeError("lockstep.batch_invariant(strict=True): aten::_grouped_mm is covered for 2-D rows "
                               "against 3-D weights with offs (the experts' forward); this form (its backward's "
                               "weight gradient, say) has no batch-invariant implementation in lockstep")
        return None
    dtype = out_dtype or self.dtype
    out = self.new_zeros((self.shape[0], mat2.shape[2]), dtype=dtype)
    start = 0
    for g, stop in enumerate(offs.tolist()):
        if stop > start:
            out[start:stop] = matmul_rows(self[start:stop], mat2[g]).to(dtype)
        start = stop
    return out


def _addmm(self, mat1, mat2, beta=1, alpha=1):
    return _scale_add(matmul_rows(mat1, mat2), self, beta, alpha)


def _bmm(self, mat2):
    return matmul_rows(self, mat2)


def _baddbmm(self, batch1, batch2, beta=1, alpha=1):
    return _scale_add(matmul_rows(batch1, batch2), self, beta, alpha)


def _addbmm(self, batch1, batch2, beta=1, alpha=1):
    products = matmul_rows(batch1, batch2).to(accumulate_dtype(batch1.dtype))
    total = products[0]
    for b in range(1, products.shape[0]):         # the batch entries in order
        total = total + products[b]
    return _scale_add(total.to(batch1.dtype), self, beta, alpha)


def _mv(self, vec):
    """A matrix-vector product as a one-column GEMM on fixed row tiles: row i has the bits of row i of
    the same matrix times any other matrix column (no GEMV path)."""
    return matmul_rows(self, vec[:, None])[:, 0]


def _addmv(self, mat, vec, beta=1, alpha=1):
    return _scale_add(_mv(mat, vec), self, beta, alpha)


def _dot(self, tensor):
    if self.is_complex():
        return None
    return matmul_rows(self[None], tensor[:, None])[0, 0]


def _out_variant(fn):
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
    return row_sum(x.reshape(1, -1).to(accumulate_dtype(x.dtype)))[0].to(x.dtype)


def _mean_all(self, dtype=None):
    x = self if dtype is None else self.to(dtype)
    return (row_sum(x.reshape(1, -1).to(accumulate_dtype(x.dtype)))[0] / max(1, x.numel())).to(x.dtype)


def _sum(self, dim=None, keepdim=False, dtype=None):
    x = self if dtype is None else self.to(dtype)
    if not x.is_floating_point():
        return None                                   # integer sums are exact in any order: run stock
    rows, dims = _rows_last(x, list(dim) if dim else [])
    out = row_sum(rows.to(accumulate_dtype(x.dtype))).to(x.dtype)
    return _restore(out, list(x.shape), dims, keepdim)


def _mean(self, dim=None, keepdim=False, dtype=None):
    x = self if dtype is None else self.to(dtype)
    rows, dims = _rows_last(x, list(dim) if dim else [])
    n = rows.shape[-1]
    out = (row_sum(rows.to(accumulate_dtype(x.dtype))) / n).to(x.dtype)
    return _restore(out, list(x.shape), dims, keepdim)


def _last(x: Tensor, dim: int) -> Tensor:
    return x.movedim(dim, -1).contiguous()


def _log_softmax(self, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else self.dtype
    x = _last(self, dim)
    xf = x.to(accumulate_dtype(x.dtype))
    shifted = xf - torch.amax(xf, dim=-1, keepdim=True)
    y = shifted - log(row_sum(exp(shifted)))[..., None]
    return y.to(out_dtype).movedim(-1, dim)


def _log_softmax_backward(grad_output, output, dim, input_dtype):
    g = _last(grad_output, dim)
    acc = accumulate_dtype(g.dtype)
    gf, yf = g.to(acc), _last(output, dim).to(acc)
    dx = gf - exp(yf) * row_sum(gf)[..., None]
    return dx.to(input_dtype).movedim(-1, dim)


def _softmax(self, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else self.dtype
    x = _last(self, dim)
    xf = x.to(accumulate_dtype(x.dtype))
    e = exp(xf - torch.amax(xf, dim=-1, keepdim=True))
    return (e / row_sum(e)[..., None]).to(out_dtype).movedim(-1, dim)


def _softmax_backward(grad_output, output, dim, input_dtype):
    g = _last(grad_output, dim)
    acc = accumulate_dtype(g.dtype)
    gf, yf = g.to(acc), _last(output, dim).to(acc)
    return (yf * (gf - row_sum(gf * yf)[..., None])).to(input_dtype).movedim(-1, dim)


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    n = math.prod(normalized_shape)
    x = input.reshape(-1, n)
    acc = accumulate_dtype(x.dtype)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    xf = x.to(acc)
    rstd = torch.rsqrt(row_sum(xf * xf) / n + eps)
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
        dot = row_sum(gw * xhat) / n
        dx = (r * (gw - xhat * dot[:, None])).to(input.dtype).reshape(input.shape)
    if output_mask[1] and weight is not None:
        dw = column_sum(gf * xhat).to(weight.dtype).reshape(weight.shape)
    return dx, dw


# --- attention -----------------------------------------------------------------------------------
def visible_mask(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """[B, Lq, Lk] bool from SDPA's arguments; the mask must not differ between heads."""
    b, lq, lk = q.shape[0], q.shape[-2], k.shape[-2]
    vis = torch.ones((b, lq, lk), dtype=torch.bool, device=q.device)
    if is_causal:
        vis &= torch.ones((lq, lk), dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        m = attn_mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        if m.shape[1] != 1 and not bool((m == m[:, :1]).all()):
            raise NotImplementedError("lockstep attention: a mask that differs between heads is not supported")
        m = m[:, 0].expand(b, lq, lk)
        if m.dtype == torch.bool:
            vis &= m
        else:
            masked = m <= torch.finfo(m.dtype).min / 2
            if not bool(((m == 0) | masked).all()):
                raise NotImplementedError("lockstep attention: float masks must hold only 0 and -inf (or the "
                                          "dtype's minimum); additive biases are not supported")
            vis &= ~masked
    return vis


def _anchor_groups(visible: Tensor) -> list[tuple[int, Tensor]]:
    """For one batch entry's [Lq, Lk] mask: (anchor key, query rows) for each distinct first visible
    key. Rows that see no key form no group (their output is zero)."""
    seen = visible.any(dim=1)
    first = visible.int().argmax(dim=1)
    groups = []
    for a in torch.unique(first[seen]).tolist():
        groups.append((a, torch.nonzero(seen & (first == a))[:, 0]))
    return groups


def masked_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """q [B, Hq, Lq, D], k, v [B, Hkv, Lk, D], visible [B, Lq, Lk] -> (out [B, Hq, Lq, D], logsumexp [B, Hq, Lq]).

    Each query's keys are re-anchored at the first key it can see, then reduced in lockstep's fixed
    64-key blocks, so left padding, right padding, a longer cache or a single decode query change no
    bit of its output. Queries that share an anchor run together."""
    acc = accumulate_dtype(q.dtype)
    b, hq, lq, _ = q.shape
    hkv = k.shape[1]
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((b, hq, lq), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(b):
        for a, rows in _anchor_groups(visible[i]):
            qi = q[i][:, rows].transpose(0, 1).to(acc)
            ki, vi = k[i, :, a:].transpose(0, 1).to(acc), v[i, :, a:].transpose(0, 1).to(acc)
            o, st = portable_attention.group_forward(qi[None], ki[None], vi[None], [ki.shape[0]], scale, False, None,
                                        visible[i][rows, a:][None])
            out[i][:, rows] = o[0].transpose(0, 1)
            g = (st[0] + log(st[1])).reshape(hkv, len(rows), hq // hkv).permute(0, 2, 1).reshape(hq, len(rows))
            lse[i][:, rows] = g.to(torch.float32)
    return out.to(q.dtype), lse


def masked_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, visible: Tensor,
                              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    acc = accumulate_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    for i in range(q.shape[0]):
        for a, rows in _anchor_groups(visible[i]):
            qi = q[i][:, rows].transpose(0, 1).to(acc)
            ki, vi = k[i, :, a:].transpose(0, 1).to(acc), v[i, :, a:].transpose(0, 1).to(acc)
            m = visible[i][rows, a:]
            _, stats = portable_attention.group_forward(qi[None], ki[None], vi[None], [ki.shape[0]], scale, False, None, m[None])
            gq, gk, gv = portable_attention.sequence_backward(qi, ki, vi, grad_out[i][:, rows].transpose(0, 1).to(acc), stats,
                                                 scale, False, None, m)
            dq[i][:, rows] = gq.transpose(0, 1)
            dk[i, :, a:] += gk.transpose(0, 1)       # anchor groups in increasing order: a fixed order
            dv[i, :, a:] += gv.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class MaskedAttention(torch.autograd.Function):
    """Differentiable `masked_attention` (used by lockstep.patch's attention function)."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale):
        ctx.save_for_backward(q, k, v, visible)
        ctx.scale = scale
        return masked_attention(q, k, v, visible, scale)[0]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, visible = ctx.saved_tensors
        return (*masked_attention_backward(grad, q, k, v, visible, ctx.scale), None, None)


def _default_scale(q: Tensor, scale) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _sdpa_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    if dropout_p > 0:
        return None
    return masked_attention(query, key, value, visible_mask(query, key, attn_mask, is_causal), _default_scale(query, scale))


def _sdpa_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
    return masked_attention_backward(grad_out, query, key, value, visible_mask(query, key, attn_mask, is_causal),
                                     _default_scale(query, scale))


def _silu(self):
    acc = accumulate_dtype(self.dtype)
    g = self.to(acc)
    return (g * (1.0 / (1.0 + exp(-g)))).to(self.dtype)


def _silu_backward(grad_output, self):
    acc = accumulate_dtype(self.dtype)
    g, dy = self.to(acc), grad_output.to(acc)
    s = 1.0 / (1.0 + exp(-g))
    return (dy * (s + g * s * (1.0 - s))).to(self.dtype)


def _erf_gelu_runs_stock() -> None:
    if _strict:
        raise RuntimeError("lockstep.batch_invariant(strict=True): aten::gelu with approximate='none' (the erf "
                           "form) has no batch-invariant implementation in lockstep; approximate='tanh' has")
    return None


def _gelu(self, approximate="none"):
    if approximate != "tanh":
        return _erf_gelu_runs_stock()
    acc = accumulate_dtype(self.dtype)
    return gelu_tanh(self.to(acc))[1].to(self.dtype)


def _gelu_backward(grad_output, self, approximate="none"):
    if approximate != "tanh":
        return _erf_gelu_runs_stock()
    acc = accumulate_dtype(self.dtype)
    g = self.to(acc)
    s, gelu = gelu_tanh(g)
    return (grad_output.to(acc) * gelu_tanh_derivative(g, s, gelu)).to(self.dtype)


def _tanh(self):
    acc = accumulate_dtype(self.dtype)
    return softcap(self.to(acc), 1.0)[0].to(self.dtype)            # 1 * tanh(x / 1), lockstep's one tanh


def _tanh_backward(grad_output, output):
    acc = accumulate_dtype(output.dtype)
    y = output.to(acc)
    return (grad_output.to(acc) * (1.0 - y * y)).to(output.dtype)


# --- registration --------------------------------------------------------------------------------
_GEMMS = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm, "addbmm": _addbmm, "mv": _mv,
          "addmv": _addmv, "dot": _dot, "vdot": _dot}
_OVERRIDES = {
    **_GEMMS,
    **{f"{name}.out": _out_variant(fn) for name, fn in _GEMMS.items()},
    **{f"{name}_": _inplace_variant(fn) for name, fn in _GEMMS.items() if name.startswith("add") or name == "baddbmm"},
    "_grouped_mm": _grouped_mm,
    "sum.default": _sum_all,
    "sum.dim_IntList": _sum,
    "sum.IntList_out": _out_variant(_sum),
    "mean.default": _mean_all,
    "mean.dim": _mean,
    "mean.out": _out_variant(_mean),
    "_log_softmax": _log_softmax,
    "_log_softmax.out": _out_variant(_log_softmax),
    "_log_softmax_backward_data": _log_softmax_backward,
    "_softmax": _softmax,
    "_softmax.out": _out_variant(_softmax),
    "_softmax_backward_data": _softmax_backward,
    "silu": _silu,
    "silu_backward": _silu_backward,
    "gelu": _gelu,
    "tanh": _tanh,
    "tanh_backward": _tanh_backward,
    "gelu_backward": _gelu_backward,
    "_fused_rms_norm": _rms_norm,
    "_fused_rms_norm_backward": _rms_norm_backward,
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward,
}


def _make(name: str, fn, original):
    def kernel(keyset, *args, **kwargs):
        if _inside():
            return original.call_boxed(keyset, *args, **kwargs)
        # Autocast has already cast this op's inputs; the kernel's own ops must not be cast again.
        with _kernel(), torch.no_grad(), _no_autocast():
            out = fn(*args, **kwargs)
        if out is None:                               # a case lockstep leaves to the stock kernel
            return original.call_boxed(keyset, *args, **kwargs)
        return out
    kernel.__name__ = f"lockstep_{name.replace('.', '_')}"
    return kernel


def _floats_in(args, kwargs) -> bool:
    items = list(args) + list(kwargs.values())
    flat = [x for a in items for x in (a if isinstance(a, (list, tuple)) else [a])]
    return any(isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) for t in flat)


def _raising(name: str, original):
    def kernel(keyset, *args, **kwargs):
        # Integer and boolean inputs are exact in any order (an attention mask's cumsum): they run stock.
        if _inside() or not _floats_in(args, kwargs):
            return original.call_boxed(keyset, *args, **kwargs)
        raise RuntimeError(f"lockstep.batch_invariant(strict=True): {name} on floating-point inputs has no "
                           "batch-invariant implementation in lockstep (see lockstep.mode.unsupported())")
    return kernel


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _register(strict: bool) -> None:
    import warnings

    keys = ["CPU"] + (["CUDA"] if torch.cuda.is_available() else [])
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        _register_into(lib, keys, strict)
    _libs.append(lib)


def _register_into(lib, keys: list[str], strict: bool) -> None:
    for key in keys:
        for name, fn in _OVERRIDES.items():
            try:
                original = torch.library.get_kernel(f"aten::{name}", key)
            except (RuntimeError, AttributeError):
                continue              # not in this torch build, or composite (it decomposes into covered ops)
            lib.impl(name, _make(name, fn, original), key, with_keyset=True)
        if strict:
            for full in UNSUPPORTED:
                name = full.removeprefix("aten::")
                try:
                    original = torch.library.get_kernel(full, key)
                    lib.impl(name, _raising(full, original), key, with_keyset=True)
                except (RuntimeError, AttributeError):
                    continue          # composite ops without a backend kernel of their own


def enable(strict: bool = False) -> None:
    """Turn the mode on for this thread (nestable); see the module docstring."""
    global _owner, _depth, _strict
    me = threading.get_ident()
    with _lock:
        if _owner is not None and _owner != me:
            raise RuntimeError(f"lockstep.batch_invariant is already active in thread {_owner}; the mode patches "
                               "process-wide kernels, so one thread at a time may hold it")
        if _depth == 0:
            _register(strict)
            _owner, _strict = me, strict
            # The overrides' GEMMs, exp and log run on the CPU backend's kernels: native where it
            # builds, whose bits do not follow MKL's blocking (docs/adr/0010).
            _kernels.enter_context(cpu_kernels("native" if registry.cpu_backend() == "native" else "torch"))
        elif strict and not _strict:
            raise RuntimeError("lockstep.batch_invariant: cannot enter strict=True inside a non-strict block")
        _depth += 1


def disable() -> None:
    """Leave the mode once; the stock kernels are back when the outermost block exits."""
    global _owner, _depth
    with _lock:
        if _depth == 0:
            return
        if _owner != threading.get_ident():
            raise RuntimeError(f"lockstep.batch_invariant: disable() from a thread that does not hold the mode "
                               f"(held by {_owner})")
        _depth -= 1
        if _depth == 0:
            while _libs:
                _libs.pop()._destroy()
            _kernels.close()
            _owner = None


def is_enabled() -> bool:
    return _depth > 0


@contextlib.contextmanager
def batch_invariant(strict: bool = False) -> Iterator[None]:
    """`with lockstep.batch_invariant():` PyTorch's matmuls, softmaxes, sums, means, RMSNorm and
    scaled_dot_product_attention run lockstep's invariant kernels; everything is restored on exit,
    also on an exception. strict=True raises on the first use of an unsupported op."""
    enable(strict)
    try:
        yield
    finally:
        disable()


def verify_coverage(seed: int = 0) -> list[dict]:
    """`coverage()` with a "verified" field: inside the mode, each covered op is run on one row and
    on 40, and "pass" means row 5 has the same bits both ways (for attention: a decode query against
    the same query in a causal prefill). Ops without a probe say "-"."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(40, 300, generator=gen), torch.randn(200, 300, generator=gen)
    q, k = torch.randn(2, 4, 17, 16, generator=gen), torch.randn(2, 2, 17, 16, generator=gen)
    experts = torch.randn(2, 300, 64, generator=gen)
    probes = {
        "aten::mm": lambda t: t @ w.t(),
        "aten::addmm": lambda t: torch.nn.functional.linear(t, w, w[:, 0]),
        "aten::bmm": lambda t: torch.bmm(t[None], w.t()[None])[0],
        "aten::matmul / aten::linear": lambda t: torch.matmul(t, w.t()),
        "aten::_log_softmax": lambda t: torch.log_softmax(t, -1),
        "aten::_softmax": lambda t: torch.softmax(t, -1),
        "aten::softmax": lambda t: t.softmax(-1),
        "aten::silu (+ backward)": torch.nn.functional.silu,
        "aten::gelu (+ backward), approximate='tanh'": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
        "aten::tanh (+ backward)": torch.tanh,
        "aten::_grouped_mm (2-D rows, 3-D weights, offs)": lambda t: torch.nn.functional.grouped_mm(
            t, experts, offs=torch.tensor([min(20, t.shape[0]), t.shape[0]], dtype=torch.int32)),
        "aten::sum": lambda t: t.sum(-1),
        "aten::mean": lambda t: t.mean(-1),
        "aten::_fused_rms_norm (+ backward)": lambda t: torch.nn.functional.rms_norm(t, (300,), w[0], 1e-6),
    }
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    with batch_invariant():
        for row in coverage():
            op, verified = row["op"], "-"
            # A probe is named by the op's full row or by its aten name before the parenthesis.
            fn = probes.get(op) or probes.get(op.split(" (")[0])
            if fn is not None:
                verified = "pass" if torch.equal(fn(x[5:6])[0], fn(x)[5]) else "FAIL"
            elif op.startswith("aten::scaled_dot_product_attention"):
                full = sdpa(q, k, k, is_causal=True, enable_gqa=True)
                one = sdpa(q[:, :, 9:10], k[:, :, :10], k[:, :, :10], enable_gqa=True)
                verified = "pass" if torch.equal(one[:, :, 0], full[:, :, 9]) else "FAIL"
            rows.append({**row, "verified": verified})
    return rows
