"""Run a backend's invariance sweeps at small sizes and print the verdicts as JSON.

tests/test_cpu_kernels.py starts this script in a fresh process for each CPU kernel selection
(OPENBLAS_CORETYPE, ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ...), because those are read once,
when the libraries load.

    python tests/_kernel_probe.py BACKEND [--ops OP,OP] [--dtypes float32,bfloat16] [--tl-dot]

--tl-dot makes the Triton GEMM call the interpreter's own tl.dot (numpy's matmul, so the BLAS
kernel OpenBLAS picked) instead of lockstep's fixed-order dot: the sweeps must then catch the
row-position dependence of the kernels that have one.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from lockstep.harness.attention_check import AttnSizes, check_attention  # noqa: E402
from lockstep.harness.check import check_op  # noqa: E402
from lockstep.harness.specs import Sizes  # noqa: E402

from _openblas import openblas_core  # noqa: E402

# Larger than one 32-row GEMM tile and one 16-query attention tile; small enough for the interpreter.
PROBE = Sizes(hidden=48, out_features=40, heads=2, head_dim=16, ffn=40, vocab=100, lm_hidden=16, embed_vocab=20,
              pool=40)
ATTN = AttnSizes(lens=(20, 1, 9), q_heads=2, kv_heads=1, head_dim=16, chunks=(7,))
# The ops whose arithmetic could reach a library kernel that the CPU model selects: in the Triton
# interpreter, the ones that multiply tiles (numpy's matmul is OpenBLAS); in the portable backend,
# and the native one, every op (ATen's vector kernels, MKL, oneDNN).
OPS = {"triton": ["linear", "selected_logprobs", "attention"],
       "native": ["linear", "selected_logprobs", "rms_norm", "log_softmax", "silu_mul", "rope", "cross_entropy",
                  "embedding", "attention"],
       "portable": ["linear", "selected_logprobs", "rms_norm", "log_softmax", "silu_mul", "rope", "cross_entropy",
                    "embedding", "attention"]}


def main(argv: list[str]) -> int:
    backend = argv[0]
    ops = argv[argv.index("--ops") + 1].split(",") if "--ops" in argv else OPS[backend]
    if "--tl-dot" in argv:
        from lockstep.backends.triton import attention, gemm

        gemm.dot_precision = attention.dot_precision = lambda dtype: "ieee"
    dtypes = argv[argv.index("--dtypes") + 1].split(",") if "--dtypes" in argv else ["float32", "bfloat16"]
    failures, checked = [], []
    for dtype in (getattr(torch, name) for name in dtypes):
        for op in ops:
            if op == "attention":
                report = check_attention(dtype, backend=backend, sizes=ATTN, with_accuracy=False)
            else:
                report = check_op(op, dtype, backend=backend, sizes=PROBE, with_accuracy=False)
            checked.append(f"{op} {dtype}")
            failures += [f"{op} {dtype} {s.sweep}: {s.detail}" for s in report.sweeps if not s.passed]
    print(json.dumps({"openblas_core": openblas_core(), "checked": checked, "failures": failures}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
