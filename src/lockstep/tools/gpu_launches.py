"""The Triton backend's launches for an NVIDIA architecture, recorded on a machine without a GPU:
what `lockstep gpu-audit` (lockstep.tools.gpu_audit) compiles and audits.

The workload runs the backend's ops, forward and backward, on CPU tensors of every dtype and flag,
with a stand-in for Triton's driver that reports the target architecture, and Triton's own
launcher computes each launch's signature, constexprs and specialization attributes. Its
`jit_cache_hook` records them and stops the launch before anything reaches a device. Every size
argument runs at several values (rows, sequences, sequence lengths, the vocabulary); a size that
reached the compiled code through Triton's integer specialization would show up as a second
binary for one kernel configuration (docs/contract.md, section 6).

Import it in a process of its own: the Triton backend must be imported with TRITON_INTERPRET=0,
and a process that has already imported it under the interpreter cannot switch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator

if "lockstep.backends.triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("lockstep.tools.gpu_launches: this process already imported the Triton backend under the "
                       "interpreter; run `lockstep gpu-audit` in a process of its own")
os.environ["TRITON_INTERPRET"] = "0"
# Say what we mean instead of leaning on Triton's default, which Triton 3.10 flips (see docs/gpu.md).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402


@dataclasses.dataclass
class Launch:
    """One launch as Triton's launcher sees it, before it compiles: the kernel, its argument
    types, its constexprs and the attributes that specialization gave its arguments."""

    kernel: str
    fn: object
    signature: dict[str, str]
    constexprs: dict
    attrs: dict
    options: dict
    case: str

    def config(self) -> dict:
        """The constexprs by name (what the backend chose: dtypes' tiles, flags, block sizes)."""
        names = list(self.signature)
        return {names[path[0]]: value for path, value in self.constexprs.items()}

    def divisible_by_16(self) -> list[str]:
        """The arguments that Triton specialized as divisible by 16 (pointers, and the GEMM's
        strides: ADR 0014). They follow a model's sizes and layouts, never the batch."""
        names = list(self.signature)
        return sorted(names[path[0]] for path, attrs in self.attrs.items()
                      if any(attr[0] == "tt.divisibility" for attr in attrs))

    def key(self) -> str:
        """What decides the binary: two launches with one key run one compiled kernel."""
        return repr((self.kernel, sorted(self.signature.items()), sorted(self.constexprs.items()),
                     sorted((k, repr(v)) for k, v in self.attrs.items()), sorted(self.options.items())))


class _AuditDriver:
    """Stands in for Triton's CUDA driver: reports the audited architecture and no device."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def recording(capability: int) -> Iterator[tuple[list[Launch], list[str]]]:
    """Inside the block, Triton launches are recorded into the yielded list and never run; the
    second list names the workload case running (set its last element)."""
    launches: list[Launch] = []
    case = ["?"]

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        options = {k: compile[k] for k in ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")}
        launches.append(Launch(fn.name, fn.jit_function, dict(compile["signature"]), dict(compile["constants"]),
                               dict(compile["configs"][0]), options, case[-1]))
        return True                 # skip the compile and the launch

    previous_hook = knobs.runtime.jit_cache_hook
    driver.set_active(_AuditDriver(capability))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield launches, case
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        if _has_default_driver():
            driver.reset_active()
        else:                       # no GPU: leave no stand-in behind for a later real lookup
            driver.set_active(None)


def _has_default_driver() -> bool:
    try:
        driver.default
        return True
    except RuntimeError:
        return False


# ---------------------------------------------------------------------------------------------
# The workload: every op of the backend, forward and backward, every dtype and flag it launches
# with, and every size argument at several values.
# ---------------------------------------------------------------------------------------------

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS = (1, 7, 16, 4096)


def _rand(*shape, dtype, grad=True):
    t = torch.randn(*shape).to(dtype)
    return t.requires_grad_(grad)


def _backward(out: torch.Tensor, *inputs: torch.Tensor) -> None:
    torch.autograd.grad(out.float().sum(), [t for t in inputs if t.requires_grad], allow_unused=True)


def _row_ops(ops, dtype, rows: int, hidden: int, vocab: int) -> Iterator[str]:
    """The row-wise ops at `rows` rows; yields the case name before each."""
    yield "linear"
    x, w, b = _rand(rows, hidden, dtype=dtype), _rand(96, hidden, dtype=dtype), _rand(96, dtype=dtype)
    _backward(ops.linear(x, w, b), x, w, b)
    _backward(ops.linear(x, w, None, split_k=2, split_n=2), x, w)
    yield "linears (the engine's grouped projections)"
    with torch.no_grad():
        ops.linears(x, [w, w[:32], w[:32]], [b, b[:32], b[:32]])     # Qwen2's q, k and v
        ops.linears(x, [w, w[:32]], None)                             # gate and up
    yield "rms_norm"
    x, w = _rand(rows, hidden, dtype=dtype), _rand(hidden, dtype=dtype)
    _backward(ops.rms_norm(x, w, eps=1e-6), x, w)
    _backward(ops.rms_norm(x, w, eps=1e-6, offset=1.0), x, w)
    yield "add_rms_norm (the engine's residual add and norm)"
    with torch.no_grad():
        ops.add_rms_norm(x, x, w, eps=1e-6)
    yield "rope"
    x, pos = _rand(rows, 2, 64, dtype=dtype), torch.arange(rows) * 3
    for style in ("neox", "gptj"):
        _backward(ops.rope(x, pos, theta=10000.0, style=style), x)
    yield "silu_mul/gelu_mul"
    g, u = _rand(rows, hidden, dtype=dtype), _rand(rows, hidden, dtype=dtype)
    _backward(ops.silu_mul(g, u), g, u)
    _backward(ops.gelu_mul(g, u), g, u)
    yield "embedding"
    w = _rand(vocab, 64, dtype=dtype)
    _backward(ops.embedding(torch.randint(0, vocab, (rows,)), w), w)
    yield "log_softmax/cross_entropy"
    logits, t = _rand(rows, vocab, dtype=dtype), torch.randint(0, vocab, (rows,))
    _backward(ops.log_softmax(logits), logits)
    _backward(ops.cross_entropy(logits, t, reduction="mean"), logits)
    yield "selected_logprobs/vocab_logprobs"
    h, w = _rand(rows, 64, dtype=dtype), _rand(vocab, 64, dtype=dtype)
    _backward(ops.selected_logprobs(h, w, t, temperature=0.7), h, w)
    _backward(ops.selected_logprobs(h, w, t, softcap=30.0), h, w)
    with torch.no_grad():
        ops.vocab_logprobs(h, w)
        ops.vocab_logprobs(h, w, softcap=30.0)


def _attention_ops(ops, dtype, lengths: list[int], head_dim: int) -> Iterator[str]:
    """Prefill, chunked prefill and paged decode over sequences of `lengths` keys, and backward."""
    hq, hkv = 4, 2
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    total = int(cu[-1])
    yield "attention prefill"
    q, k, v = (_rand(total, h, head_dim, dtype=dtype) for h in (hq, hkv, hkv))
    for causal, window in ((True, None), (False, None), (True, 8)):
        _backward(ops.attention(q, k, v, cu, cu, causal=causal, window=window), q, k, v)
    yield "attention chunked"
    chunk = [max(1, n // 3) for n in lengths]
    cu_q = torch.tensor([0] + list(torch.tensor(chunk).cumsum(0)), dtype=torch.int32)
    qc = _rand(int(cu_q[-1]), hq, head_dim, dtype=dtype)
    _backward(ops.attention(qc, k, v, cu_q, cu), qc, k, v)
    yield "paged decode"
    block_size = 16
    blocks = [(n + block_size - 1) // block_size for n in lengths]
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    start = 0
    for b, nb in enumerate(blocks):
        table[b, :nb] = torch.arange(start, start + nb)
        start += nb
    k_cache = torch.randn(start, block_size, hkv, head_dim).to(dtype)
    v_cache = torch.randn(start, block_size, hkv, head_dim).to(dtype)
    q1 = torch.randn(len(lengths), hq, head_dim).to(dtype)
    cu1 = torch.arange(len(lengths) + 1, dtype=torch.int32)
    with torch.no_grad():
        for window in (None, 8):
            ops.paged_attention(q1, k_cache, v_cache, table, torch.tensor(lengths), cu1, window=window)
    yield "paged decode, the engine's step"
    # The engine's decode step (build_step's): the kernel reads the step's int64 metadata in place.
    from ..paged_cache import build_step
    from ..rotary import Rotation

    spans = [(table[b, :nb].tolist(), n - 1, n) for b, (nb, n) in enumerate(zip(blocks, lengths))]
    step, _ = build_step(spans, block_size)
    k1, v1 = (torch.randn(len(lengths), hkv, head_dim).to(dtype) for _ in range(2))
    with torch.no_grad():
        for window in (None, 8):
            ops.cached_attention(q1, k1, v1, k_cache, v_cache, step, window=window)
        for style in ("neox", "gptj"):          # rope and the cache write in one launch
            ops.cached_attention(q1, k1, v1, k_cache, v_cache, step, rope=Rotation(step.host.positions, 1e4, style))
    yield "masked attention"
    width = max(lengths)
    visible = torch.zeros(len(lengths), width, width, dtype=torch.bool)
    for b, n in enumerate(lengths):                             # left-padded causal sequences
        visible[b, width - n:, width - n:] = torch.ones(n, n, dtype=torch.bool).tril()
    qm, km, vm = (_rand(len(lengths), h, width, head_dim, dtype=dtype) for h in (hq, hkv, hkv))
    _backward(ops.masked_attention(qm, km, vm, visible)[0], qm, km, vm)


def workload() -> Iterator[str]:
    """Runs the backend's ops; yields a description of each case before it runs."""
    from .. import ops
    from ..registry import use_backend

    with use_backend("triton"):
        for dtype in DTYPES:
            name = str(dtype).removeprefix("torch.")
            for rows in ROWS:
                for op in _row_ops(ops, dtype, rows, hidden=320, vocab=3000):
                    yield f"{op} {name} rows={rows}"
            for hidden, vocab in ((1024, 151936), (576, 49152), (48, 40)):
                for op in _row_ops(ops, dtype, 2, hidden=hidden, vocab=vocab):
                    yield f"{op} {name} hidden={hidden} vocab={vocab}"
            for lengths in ([5], [1, 17, 64], [70, 3, 129, 1, 40, 33, 16, 200]):
                for head_dim in (64, 128):
                    for op in _attention_ops(ops, dtype, lengths, head_dim):
                        yield f"{op} {name} seqs={len(lengths)} lengths={lengths} head_dim={head_dim}"


def record(capability: int) -> list[Launch]:
    """Every launch of the workload on an architecture of `capability` (80, 90, 100)."""
    torch.manual_seed(0)
    with recording(capability) as (launches, case):
        for name in workload():
            case.append(name)
    return launches

