"""Speed of lockstep's ops against eager PyTorch, measured in the same run and reported as ratios.

Each case times the forward and forward+backward of one op at one shape on the chosen backend and
on "eager", taking the median of several repeats after a warm-up. `lockstep bench` prints the table;
benchmarks/bench_<op>.py run one op each.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .. import ops
from ..registry import cpu_backend, use_backend


@dataclass
class Case:
    op: str
    shape: str
    dtype: torch.dtype
    make: Callable[[], tuple[Callable[[], torch.Tensor], list[torch.Tensor]]]  # (run, leaves)
    backward: bool = True


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def _leaf(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype).requires_grad_()


def cases(quick: bool = False) -> list[Case]:
    out: list[Case] = []
    rows_list = (1, 16, 256) if quick else (1, 16, 256, 2048)
    widths = (1024,) if quick else (1024, 4096)
    for dtype in (torch.float32, torch.bfloat16):
        for k in widths:
            for m in rows_list:
                def lin(m=m, k=k, dtype=dtype):
                    x, w = _leaf(m, k, dtype=dtype), _leaf(k, k, dtype=dtype, scale=k ** -0.5)
                    return (lambda: ops.linear(x, w)), [x, w]
                out.append(Case("linear", f"M={m} N=K={k}", dtype, lin))

                def rms(m=m, k=k, dtype=dtype):
                    x, w = _leaf(m, k, dtype=dtype), _leaf(k, dtype=dtype)
                    return (lambda: ops.rms_norm(x, w)), [x, w]
                out.append(Case("rms_norm", f"rows={m} H={k}", dtype, rms))
        for m in rows_list[-2:]:
            def silu(m=m, dtype=dtype):
                g, u = _leaf(m, 4096, dtype=dtype), _leaf(m, 4096, dtype=dtype)
                return (lambda: ops.silu_mul(g, u)), [g, u]
            out.append(Case("silu_mul", f"rows={m} F=4096", dtype, silu))

            def gelu(m=m, dtype=dtype):
                g, u = _leaf(m, 4096, dtype=dtype), _leaf(m, 4096, dtype=dtype)
                return (lambda: ops.gelu_mul(g, u)), [g, u]
            out.append(Case("gelu_mul", f"rows={m} F=4096", dtype, gelu))

            def rope(m=m, dtype=dtype):
                x, pos = _leaf(m, 32, 128, dtype=dtype), torch.arange(m)
                return (lambda: ops.rope(x, pos)), [x]
            out.append(Case("rope", f"tokens={m} 32x128", dtype, rope))

            def emb(m=m, dtype=dtype):
                ids, w = torch.randint(0, 32000, (m,)), _leaf(32000, 1024, dtype=dtype)
                return (lambda: ops.embedding(ids, w)), [w]
            out.append(Case("embedding", f"tokens={m} V=32000 D=1024", dtype, emb))
        for m in (16, 256):
            def lsm(m=m, dtype=dtype):
                x = _leaf(m, 32000, dtype=dtype)
                return (lambda: ops.log_softmax(x)), [x]
            out.append(Case("log_softmax", f"rows={m} V=32000", dtype, lsm))

            def ce(m=m, dtype=dtype):
                x, t = _leaf(m, 32000, dtype=dtype), torch.randint(0, 32000, (m,))
                return (lambda: ops.cross_entropy(x, t)), [x]
            out.append(Case("cross_entropy", f"rows={m} V=32000", dtype, ce))
        vocabs = (32000,) if quick else (32000, 152064)
        for v in vocabs:
            for m in (16, 256):
                def slp(m=m, v=v, dtype=dtype):
                    h, w = _leaf(m, 1024, dtype=dtype), _leaf(v, 1024, dtype=dtype, scale=1024 ** -0.5)
                    t = torch.randint(0, v, (m,))
                    return (lambda: ops.selected_logprobs(h, w, t)), [h, w]
                out.append(Case("selected_logprobs", f"tokens={m} D=1024 V={v}", dtype, slp))
            for m in (1, 32):                 # a sampler's rows: decode steps of 1 and 32 requests
                def vlp(m=m, v=v, dtype=dtype):
                    h, w = _leaf(m, 1024, dtype=dtype), _leaf(v, 1024, dtype=dtype, scale=1024 ** -0.5)
                    return (lambda: ops.vocab_logprobs(h, w)), [h, w]
                out.append(Case("vocab_logprobs", f"tokens={m} D=1024 V={v}", dtype, vlp, backward=False))
    for dtype in (torch.float32, torch.bfloat16):
        for seq in ((512,) if quick else (512, 2048)):
            for d in ((64,) if quick else (64, 128)):
                def attn(seq=seq, d=d, dtype=dtype):
                    q, k, v = _leaf(seq, 8, d, dtype=dtype), _leaf(seq, 2, d, dtype=dtype), _leaf(seq, 2, d, dtype=dtype)
                    cu = torch.tensor([0, seq])
                    return (lambda: ops.attention(q, k, v, cu, cu)), [q, k, v]
                out.append(Case("attention", f"prefill seq={seq} d={d} 8q:2kv", dtype, attn))

        def decode(dtype=dtype):
            ctx = 2048
            q, k, v = _leaf(1, 8, 128, dtype=dtype), _leaf(ctx, 2, 128, dtype=dtype), _leaf(ctx, 2, 128, dtype=dtype)
            cq, ck = torch.tensor([0, 1]), torch.tensor([0, ctx])
            return (lambda: ops.attention(q, k, v, cq, ck)), [q, k, v]
        out.append(Case("attention", "decode 1 query over 2048 keys d=128 8q:2kv", dtype, decode, backward=False))

        def padded(dtype=dtype):
            # 4 left-padded causal sequences of 512, 384, 256 and 128 tokens in a batch of 512 (a
            # transformers model's padded batch under lockstep.patch or the mode)
            q, k, v = _leaf(4, 8, 512, 64, dtype=dtype), _leaf(4, 2, 512, 64, dtype=dtype), _leaf(4, 2, 512, 64, dtype=dtype)
            visible = torch.zeros(4, 512, 512, dtype=torch.bool)
            for b, n in enumerate((512, 384, 256, 128)):
                visible[b, 512 - n:, 512 - n:] = torch.ones(n, n, dtype=torch.bool).tril()
            return (lambda: ops.masked_attention(q, k, v, visible)[0]), [q, k, v]
        out.append(Case("masked_attention", "4 left-padded causal sequences, 512 positions, d=64 8q:2kv", dtype,
                        padded))
    return out


def run_case(case: Case, backend: str, repeats: int) -> tuple[float, float | None]:
    torch.manual_seed(0)
    fn, leaves = case.make()
    with use_backend(backend):
        with torch.no_grad():
            fwd = _time(fn, repeats)
        both = None
        if case.backward:
            def step():
                for t in leaves:
                    t.grad = None
                fn().float().sum().backward()
            both = _time(step, repeats)
    return fwd, both


def peak_rss_mib(fn: Callable[[], object]) -> float | None:
    """Peak resident memory growth while fn runs (Linux: resets VmHWM through clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
        fn()
        return (_status("VmHWM") - before) / 1024
    except OSError:
        return None


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(field)


def memory_case(tokens: int = 1024, hidden: int = 1024, vocab: int = 152064) -> dict[str, float | None]:
    """Peak memory of selected_logprobs against log_softmax over the full logits, forward+backward."""
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden).requires_grad_()
    w = (torch.randn(vocab, hidden) / hidden ** 0.5).requires_grad_()
    t = torch.randint(0, vocab, (tokens,))

    def fused():
        ops.selected_logprobs(h, w, t).sum().backward()

    def full():
        with use_backend("eager"):
            ops.log_softmax(ops.linear(h, w)).gather(1, t[:, None]).sum().backward()

    return {"selected_logprobs": peak_rss_mib(fused), "log_softmax(full logits)": peak_rss_mib(full)}


def cpu_name() -> str:
    """The CPU's model, maker and family as Linux reports them ("AMD EPYC (AuthenticAMD, family 26)"),
    or what platform knows elsewhere: the bits of stock BLAS and vector math follow all three."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    maker = ", ".join(x for x in (fields.get("vendor_id"), fields.get("cpu family") and f"family {fields['cpu family']}")
                      if x)
    return f"{model} ({maker})" if maker else model


def machine() -> str:
    """The CPU (cpu_name), its cores, torch's threads and torch's version: where a number was measured."""
    return f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main(selected: list[str] | None = None, quick: bool = False, out: str | None = None,
         backend: str | None = None) -> int:
    """Time `selected` ops (default all) on `backend` (default: the CPU's, native where it builds)
    against eager PyTorch; print a markdown table, appended to `out` when given."""
    backend = backend or cpu_backend()
    repeats = 3 if quick else 5
    rows = []
    header = f"| op | dtype | shape | fwd {backend} ms | fwd eager ms | fwd ratio | fwd+bwd {backend} ms | fwd+bwd eager ms | fwd+bwd ratio |"
    print(f"machine: {machine()}")
    print(header)
    print("|" + "---|" * 9)
    for case in cases(quick):
        if selected and case.op not in selected:
            continue
        f_l, b_l = run_case(case, backend, repeats)
        f_e, b_e = run_case(case, "eager", repeats)
        dt = str(case.dtype).removeprefix("torch.")
        both = f"{b_l:.2f} | {b_e:.2f} | {b_l / b_e:.2f}" if b_l is not None else "- | - | -"
        line = f"| {case.op} | {dt} | {case.shape} | {f_l:.2f} | {f_e:.2f} | {f_l / f_e:.2f} | {both} |"
        print(line, flush=True)
        rows.append(line)
    mem = None
    if not selected or "selected_logprobs" in selected:
        mem = memory_case(tokens=256 if quick else 1024)
        print(f"\npeak memory growth, fwd+bwd, 152k vocab: {mem}")
    if out:
        with open(out, "a") as f:
            f.write(f"\nMachine: {machine()}\n\n{header}\n|" + "---|" * 9 + "\n")
            f.write("\n".join(rows) + "\n")
            if mem:
                f.write(f"\nPeak memory growth, fwd+bwd, 152k vocab: {mem}\n")
    return 0
