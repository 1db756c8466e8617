"""What the mode covers: the aten ops it overrides, how, in which dtypes; and the ops it leaves
stock because lockstep cannot make their reduction order invariant. "how" says what CPU tensors
run; on CUDA tensors the GEMM family, RMSNorm, log_softmax, softmax and SDPA run the Triton
backend's kernels (docs/adr/0039)."""

from __future__ import annotations

import torch

# (aten op, what lockstep does, dtypes). "+ out=, _" means the out= overload and the in-place form.
COVERAGE: list[tuple[str, str, str]] = [
    ("aten::mm (+ out=)", "fixed 128/8-row GEMM tiles (4-row in bf16 on CPU); on CUDA the Triton GEMM, every tile "
     "reducing K in order", "fp32 bf16 fp16 fp64"),
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
    ("aten::scaled_dot_product_attention on CUDA", "its flash, memory-efficient and cuDNN forms (+ backward), and "
     "the math form at the autograd key: the Triton masked attention, as on CPU", "fp32 bf16 fp16 fp64"),
]

# Float ops with a reduction whose order lockstep does not control. They run stock; with strict=True
# they raise on floating-point inputs (on integer ones they are exact, and run).
UNSUPPORTED = [
    "aten::var.correction", "aten::std.correction", "aten::var_mean.correction", "aten::std_mean.correction",
    "aten::native_layer_norm", "aten::native_group_norm", "aten::native_batch_norm", "aten::linalg_vector_norm",
    "aten::norm.ScalarOpt_dim", "aten::cumsum", "aten::cumprod", "aten::prod", "aten::prod.dim_int",
    "aten::logsumexp", "aten::nll_loss_forward", "aten::nll_loss2d_forward", "aten::embedding_dense_backward",
    "aten::index_add", "aten::scatter_add", "aten::_scaled_dot_product_attention_math", "aten::convolution",
]


def unsupported() -> list[str]:
    """aten ops the mode cannot make batch-invariant; they run stock (or raise with strict=True)."""
    return list(UNSUPPORTED)


def coverage() -> list[dict]:
    """One row per covered op (status "invariant") and per unsupported one."""
    devices = "CPU, CUDA" if torch.cuda.is_available() else "CPU (CUDA when present)"
    rows = [{"op": op, "how": how, "dtypes": dt, "devices": devices, "status": "invariant"} for op, how, dt in COVERAGE]
    rows += [{"op": op, "how": "not overridden", "dtypes": "-", "devices": "-", "status": "unsupported"}
             for op in UNSUPPORTED]
    return rows
