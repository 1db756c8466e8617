"""Float64 reference implementations of every op, written for clarity.

They share no code with the kernels: each is the textbook formula in float64 PyTorch, and autograd
through it gives the reference gradients. Inputs of any float dtype are promoted to float64; outputs
are float64. The functions take the public ops' signatures (`reference.linear(x, weight, bias)`),
which is how the harness calls them; each module also registers its op as the "reference" backend,
so that a whole model can run on them (the chain of docs/contract.md, section 4: run the model in
float64 under `use_backend("reference")`).
"""

from .attention import attention
from .cross_entropy import cross_entropy
from .embedding import embedding
from .gelu_mul import gelu_mul
from .linear import linear
from .log_softmax import log_softmax
from .masked_attention import masked_attention
from .rms_norm import rms_norm
from .rope import rope
from .selected_logprobs import selected_logprobs
from .silu_mul import silu_mul
from .vocab_logprobs import vocab_logprobs

__all__ = ["attention", "cross_entropy", "embedding", "gelu_mul", "linear", "log_softmax", "masked_attention", "rms_norm", "rope",
           "selected_logprobs", "silu_mul", "vocab_logprobs"]
