"""lockstep's operators: batch-invariant and deterministic, forward and backward.

Every op validates its arguments here and then runs the implementation chosen by the backend
registry (`lockstep.use_backend`), so callers never change when a backend does. Under
torch.autocast each op casts its inputs as autocast would for the aten op it stands for
(lockstep.autocast).
"""

from ..rotary import LinearRopeScaling, Llama3RopeScaling, rope_inv_freq
from .attention import attention, cached_attention, paged_attention, write_kv
from .cross_entropy import cross_entropy
from .embedding import embedding
from .gelu_mul import gelu_mul
from .linear import linear, linears
from .log_softmax import log_softmax
from .masked_attention import masked_attention
from .rms_norm import add_rms_norm, rms_norm
from .rope import rope
from .selected_logprobs import selected_logprobs
from .silu_mul import silu_mul
from .vocab_logprobs import vocab_logprobs

__all__ = [
    "add_rms_norm", "attention", "cached_attention", "paged_attention", "write_kv", "cross_entropy", "embedding", "gelu_mul", "linear", "linears", "log_softmax", "masked_attention", "rms_norm", "rope", "rope_inv_freq",
    "Llama3RopeScaling", "LinearRopeScaling", "selected_logprobs", "silu_mul", "vocab_logprobs",
]
