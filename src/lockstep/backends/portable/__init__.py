"""The portable backend: PyTorch ops in fixed tile shapes and fixed reduction orders, any device."""

from . import (  # noqa: F401
    attention,
    cross_entropy,
    embedding,
    gelu_mul,
    linear,
    log_softmax,
    masked_attention,
    rms_norm,
    rope,
    selected_logprobs,
    silu_mul,
    vocab_logprobs,
)
