"""The Triton backend: every op of lockstep.ops as Triton kernels (GPU; on CPU under TRITON_INTERPRET=1)."""

from . import attention, elementwise, linear, rms_norm, selected_logprobs, softmax  # noqa: F401
