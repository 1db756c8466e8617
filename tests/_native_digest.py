"""Print a digest of the native backend's outputs and gradients, for tests/test_native.py.

Every op of the harness (forward and backward, fp32, bf16 and fp16, small sizes), attention by
packed prefill with gradients and by paged decode, and masked attention (left padding) with
gradients. One digest per thread count (1, 2, 3) of one process; the instruction set and the BLAS
selections come from the environment, which the kernel libraries read once, so the test starts a
fresh process for each.

    python tests/_native_digest.py   ->   {"isa": "avx512", "digests": {"1": "...", "2": ..., "3": ...}}
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from lockstep.backends.native.build import isa_name
from lockstep.harness.attention_check import AttnCase, AttnSizes, _paged_decode
from lockstep.harness.masked_attention_check import MaskedCase, MaskedSizes
from lockstep.harness.check import Pool, run
from lockstep.harness.specs import SPECS, Sizes

# Big enough that the GEMMs of linear, the LM head and attention run on several threads (kernels.c
# keeps products under 2^18 multiply-adds on one), small enough for the scalar path.
SIZES = Sizes(hidden=264, out_features=100, heads=2, head_dim=16, ffn=40, vocab=4200, lm_hidden=72, embed_vocab=20,
              pool=40)
ATTN = AttnSizes(lens=(20, 1, 90), q_heads=4, kv_heads=2, head_dim=40, chunks=(7,))
MASKED = MaskedSizes(lens=(20, 1, 90), q_heads=4, kv_heads=2, head_dim=40)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _update(h: "hashlib._Hash", label: str, t: torch.Tensor | None) -> None:
    h.update(label.encode())
    if t is not None:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def digest() -> str:
    h = hashlib.sha256()
    for dtype in DTYPES:
        for name, spec in SPECS.items():
            pool = Pool(spec, dtype, SIZES, seed=0, grad=spec.differentiable)
            r = run(pool, "native", list(range(SIZES.pool)))
            _update(h, f"{name} {dtype} out", r.out)
            for key in sorted(r.row_grads):
                _update(h, f"{name} {dtype} d{key}", r.row_grads[key])
            for key in sorted(r.param_grads):
                _update(h, f"{name} {dtype} d{key}", r.param_grads[key])
        case = AttnCase(dtype, ATTN, seed=0)
        per, _ = case.prefill("native", list(range(len(case.seqs))), grad=True)
        for i, tensors in enumerate(per):
            for j, t in enumerate(tensors):
                _update(h, f"attention {dtype} {i} {j}", t)
        for i, t in enumerate(_paged_decode(case, "native")):
            _update(h, f"paged_attention {dtype} {i}", t)
        masked = MaskedCase(dtype, MASKED, seed=0)
        for i, tensors in enumerate(masked.run("native", list(range(len(masked.seqs))), grad=True, left=True)):
            for j, t in enumerate(tensors):
                _update(h, f"masked_attention {dtype} {i} {j}", t)
    return h.hexdigest()


def main() -> int:
    out = {}
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        out[str(threads)] = digest()
    print(json.dumps({"isa": isa_name(), "digests": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
