"""torch.autocast for lockstep's ops: the casts autocast would make, then the kernel with autocast off.

lockstep's kernels are autograd Functions, which autocast does not see, and their inner aten calls
(fp32 accumulators, fixed-tile GEMMs) must not be cast again. So each public op applies autocast's
policy to its own inputs, as PyTorch does for the aten op it stands for, and runs its kernel under
`off()`:

- the matmul family (linear, attention, paged_attention, selected_logprobs' LM head) runs in the
  autocast dtype, like aten's linear, mm and scaled_dot_product_attention;
- cross_entropy runs in fp32, and on CUDA log_softmax too, like aten's;
- the rest (rms_norm, rope, silu_mul, gelu_mul, embedding) run in their inputs' dtype; under autocast a mix
  of dtypes (a bf16 activation and an fp32 weight) runs in the wider one, as PyTorch's type
  promotion would.
"""

from __future__ import annotations

import contextlib
import torch
from torch import Tensor

LOWER_PRECISION = frozenset({"linear", "attention", "paged_attention", "masked_attention", "selected_logprobs"})
FP32 = {"cpu": frozenset({"cross_entropy"}), "cuda": frozenset({"cross_entropy", "log_softmax"})}


def enabled(device_type: str) -> bool:
    return device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)


def cast(op: str, *tensors) -> tuple:
    """`tensors` as autocast would hand them to `op`: floating-point tensors cast by the policy of
    the device of the first tensor; anything else passes unchanged."""
    first = tensors[0] if tensors and isinstance(tensors[0], Tensor) else \
        next((t for t in tensors if isinstance(t, Tensor)), None)      # an op's first input, nearly always
    if first is None or not enabled(first.device.type):
        return tensors
    device_type = first.device.type
    if op in LOWER_PRECISION:
        target = torch.get_autocast_dtype(device_type)
    elif op in FP32.get(device_type, ()):
        target = torch.float32
    else:
        floats = [t.dtype for t in tensors if isinstance(t, Tensor) and t.is_floating_point()]
        if len(set(floats)) < 2:
            return tensors
        target = floats[0]
        for dtype in floats[1:]:
            target = torch.promote_types(target, dtype)
    return tuple(t.to(target) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


_NOTHING = contextlib.nullcontext()


def off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast disabled for `device_type` inside the block (a no-op when it is not enabled, which
    costs an op call next to nothing)."""
    return torch.autocast(device_type, enabled=False) if enabled(device_type) else _NOTHING
