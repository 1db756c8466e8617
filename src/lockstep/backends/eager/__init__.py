"""The "eager" backend: plain PyTorch, written the way model code usually is. Not invariant.

It exists for comparison: `lockstep check --backend eager` shows where stock PyTorch breaks the
contract, and the relative-accuracy criterion measures lockstep against it.
"""

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
