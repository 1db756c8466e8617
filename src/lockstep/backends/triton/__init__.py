"""The Triton backend: every op of lockstep.ops as Triton kernels, one module per op (GPU; on a
machine without CUDA, under Triton's interpreter, which must be chosen before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from . import (  # noqa: E402,F401
    attention,
    cross_entropy,
    embedding,
    gelu_mul,
    linear,
    log_softmax,
    rms_norm,
    rope,
    selected_logprobs,
    silu_mul,
    vocab_logprobs,
)
