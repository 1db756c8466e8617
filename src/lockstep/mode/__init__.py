"""Batch-invariant mode: route PyTorch's own operators to lockstep's kernels.

    with lockstep.batch_invariant():
        logits = hf_model(input_ids).logits       # now bitwise the same alone, batched or padded

`lockstep.batch_invariant`, `lockstep.enable` and `lockstep.disable` are this module's functions;
`lockstep.mode.unsupported()` and `lockstep.mode.coverage()` describe what it covers.

`enable()` registers overrides with torch.library on the CPU (and CUDA, when present) dispatch keys
of the aten ops in `COVERAGE`; `disable()` removes them, which restores the stock kernels. The
package: `coverage` (what is covered), `routes` (which kernels a call runs, by its device: the CPU
route's `kernels` and `attention` on CPU tensors, the Triton route's `triton_kernels` on CUDA
tensors, docs/adr/0039), `dispatch` (the registration), `state` (strict, and whether a kernel of
the mode is running). The kernels call aten ops themselves (torch.mm on fixed tiles, ...), so an
override that is entered from inside a lockstep kernel calls the original kernel, which it holds
through torch.library.get_kernel.

The registrations are process-wide. One thread at a time may hold the mode (entering it from a
second thread raises); nesting in one thread is fine. Ops that lockstep cannot make invariant are
listed by `unsupported()`. They run unchanged, or raise on first use with `strict=True`.
"""

from __future__ import annotations

import torch

from .attention import visible_mask
from .coverage import COVERAGE, UNSUPPORTED, coverage, unsupported
from .dispatch import batch_invariant, disable, enable, is_enabled

__all__ = ["batch_invariant", "enable", "disable", "is_enabled", "coverage", "unsupported", "verify_coverage",
           "COVERAGE", "UNSUPPORTED", "visible_mask"]


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
            elif op.startswith("aten::scaled_dot_product_attention") and "on CUDA" not in op:
                full = sdpa(q, k, k, is_causal=True, enable_gqa=True)
                one = sdpa(q[:, :, 9:10], k[:, :, :10], k[:, :, :10], enable_gqa=True)
                verified = "pass" if torch.equal(one[:, :, 0], full[:, :, 9]) else "FAIL"
            rows.append({**row, "verified": verified})
    return rows
