"""GPU benchmark of the Triton backend against cuBLAS / PyTorch / SDPA (needs a CUDA device).

bf16 linear for M in {1, 16, 128, 512, 2048, 8192} and (N, K) in {(4096, 4096), (14336, 4096),
(4096, 14336)}, forward and backward; rms_norm; selected_logprobs at a 152k vocabulary; attention
prefill (2k-8k) and decode over 4k cached keys; Engine.generate against transformers' generate at 1,
8 and 64 requests on a Qwen3-0.6B-shaped model (random weights); a decode step's kernel launches,
copies and host reads on it; the mode's overhead on that model's forward. Reports time ratios measured in the same run (ratio < 1: lockstep faster).

`--json PATH` also writes what Triton compiled on this GPU (registers, spills, shared memory, warps
per kernel and specialization), to set beside `lockstep gpu-audit`'s figures for the same arch."""

import json
import sys
import time

import torch

import lockstep
from lockstep import Engine, SamplingParams, ops

from _realistic import hf_model, lockstep_model


def write_json(data) -> None:
    """`data` as JSON to the path after `--json` on the command line, if there is one."""
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(data, f, indent=1)


def bench(fn, repeats=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; nothing measured")
        return 1
    dev, bf = "cuda", torch.bfloat16
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "--model-only" not in sys.argv:
        op_rows(dev, bf)
    model_rows(dev)
    if "--json" in sys.argv:  # gathering the compiled kernels' figures costs a pass over Triton's cache
        write_json(compiled_kernels())
    return 0


def op_rows(dev: str, bf: torch.dtype) -> None:
    print("| op | shape | lockstep ms | torch ms | lockstep / torch |\n|---|---|---|---|---|")
    with lockstep.use_backend("triton"):
        for n, k in ((4096, 4096), (14336, 4096), (4096, 14336)):
            w = torch.randn(n, k, device=dev, dtype=bf) / k ** 0.5
            for m in (1, 16, 128, 512, 2048, 8192):
                x = torch.randn(m, k, device=dev, dtype=bf)
                a, b = bench(lambda: ops.linear(x, w)), bench(lambda: x @ w.t())
                print(f"| linear fwd | M={m} N={n} K={k} | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)
                xg = x.clone().requires_grad_()
                wg = w.clone().requires_grad_()
                gy = torch.randn(m, n, device=dev, dtype=bf)
                a = bench(lambda: torch.autograd.grad(ops.linear(xg, wg), (xg, wg), gy))
                b = bench(lambda: torch.autograd.grad(xg @ wg.t(), (xg, wg), gy))
                print(f"| linear fwd+bwd | M={m} N={n} K={k} | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)
        for m in (16, 2048, 8192):
            x = torch.randn(m, 4096, device=dev, dtype=bf)
            nw = torch.ones(4096, device=dev, dtype=bf)
            a = bench(lambda: ops.rms_norm(x, nw))
            b = bench(lambda: torch.nn.functional.rms_norm(x, (4096,), nw, 1e-6))
            print(f"| rms_norm | rows={m} H=4096 | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)
        for m in (256, 2048):
            h = torch.randn(m, 4096, device=dev, dtype=bf)
            head = torch.randn(152064, 4096, device=dev, dtype=bf) / 64
            t = torch.randint(0, 152064, (m,), device=dev)
            a = bench(lambda: ops.selected_logprobs(h, head, t), 5)
            b = bench(lambda: torch.log_softmax((h @ head.t()).float(), -1).gather(1, t[:, None]), 5)
            print(f"| selected_logprobs | tokens={m} V=152064 D=4096 | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)
        for seq in (2048, 8192):
            q = torch.randn(seq, 32, 128, device=dev, dtype=bf)
            kv = torch.randn(seq, 8, 128, device=dev, dtype=bf)
            cu = torch.tensor([0, seq], device=dev)
            a = bench(lambda: ops.attention(q, kv, kv, cu, cu), 5)
            qs, ks = q.transpose(0, 1)[None], kv.transpose(0, 1)[None]
            b = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, ks, is_causal=True,
                                                                              enable_gqa=True), 5)
            print(f"| attention prefill | seq={seq} 32q:8kv d=128 | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)
        ctx = 4096
        q1 = torch.randn(1, 32, 128, device=dev, dtype=bf)
        kv = torch.randn(ctx, 8, 128, device=dev, dtype=bf)
        a = bench(lambda: ops.attention(q1, kv, kv, torch.tensor([0, 1], device=dev), torch.tensor([0, ctx], device=dev)))
        b = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q1.transpose(0, 1)[None],
                                                                          kv.transpose(0, 1)[None],
                                                                          kv.transpose(0, 1)[None], enable_gqa=True))
        print(f"| attention decode | 1 query, {ctx} keys | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)


def model_rows(dev: str, layers: int = 28, prompt: int = 128, new: int = 64) -> None:
    """Engine.generate vs transformers' generate (greedy, SDPA, KV cache), and the mode's overhead on
    one batched forward, on the Qwen3-0.6B shape with all of its 28 layers."""
    ours = lockstep_model(torch.bfloat16, layers=layers).to(dev)
    hf = hf_model(ours).to(dev)
    print("\n| requests | lockstep engine tok/s | with CUDA graphs tok/s | transformers generate tok/s | "
          "engine / transformers | with graphs / transformers |\n|---|---|---|---|---|---|")
    warm = Engine(ours, max_num_seqs=2, max_num_batched_tokens=4096, block_size=16)
    warm.generate([[1] * prompt] * 2, SamplingParams(temperature=0, max_new_tokens=4))     # compiles the kernels
    for n in (1, 8, 64):
        prompts = torch.randint(0, 151936, (n, prompt), generator=torch.Generator().manual_seed(n))
        t_engine = {}
        for graphs in (False, True):
            engine = Engine(ours, max_num_seqs=n, max_num_batched_tokens=max(4096, n * prompt), block_size=16,
                            cuda_graphs=graphs)
            if graphs:      # each bucket's capture happens once per engine: outside the timed run
                engine.generate(prompts[:, :8].tolist(), SamplingParams(temperature=0, max_new_tokens=4))
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = engine.generate(prompts.tolist(), SamplingParams(temperature=0, max_new_tokens=new))
            torch.cuda.synchronize()
            t_engine[graphs] = time.perf_counter() - t
            assert all(len(o.token_ids) == new for o in outs)
            if graphs:
                assert [o.token_ids for o in outs] == plain, "the replayed decode drew other tokens"
            plain = [o.token_ids for o in outs]
        ids = prompts.to(dev)
        with torch.no_grad():
            hf.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=2, do_sample=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False)
            torch.cuda.synchronize()
        t_hf = time.perf_counter() - t
        a, g, b = n * new / t_engine[False], n * new / t_engine[True], n * new / t_hf
        print(f"| {n} | {a:.0f} | {g:.0f} | {b:.0f} | {a / b:.2f} | {g / b:.2f} |", flush=True)
    decode_step_work(ours)
    ids = torch.randint(0, 151936, (8, 512), device=dev)
    with torch.no_grad():
        stock = bench(lambda: hf(ids).logits, 5)
        with lockstep.batch_invariant():
            inside = bench(lambda: hf(ids).logits, 5)
    print(f"\n| the mode | transformers forward, 8 x 512 tokens, {layers} layers | {inside:.2f} ms | "
          f"{stock:.2f} ms stock | {inside / stock:.2f} |", flush=True)


def decode_step_work(ours, rows: int = 8, prompt: int = 32) -> None:
    """One decode step of `rows` sequences: the kernels it launches (the profiler's CUDA events:
    Triton's launches included, which aten counting misses), its copies, and its reads of tensor
    data back to the host (lockstep.tools.host_work)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from lockstep.tools.host_work import HostWork

    engine = Engine(ours, max_num_seqs=rows, max_num_batched_tokens=rows * prompt, block_size=16)
    for i in range(rows):
        engine.add_request([1 + i] * prompt, SamplingParams(temperature=0, max_new_tokens=8))
    engine.step()                                   # the prompts
    engine.step()
    torch.cuda.synchronize()
    with HostWork() as work, profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = sum("memcpy" in e.name.lower() or "memset" in e.name.lower() for e in events)
    layers = len(ours.model.layers)
    print(f"\n| decode step, {rows} rows, {layers} layers | {len(events) - copies} kernels "
          f"({(len(events) - copies) / layers:.1f} per layer) | {copies} copies | {work.total_reads} reads "
          f"{dict(work.reads)} |", flush=True)


def compiled_kernels() -> list[dict]:
    """Each Triton kernel of the backend that compiled in this process: its specialization key and
    the compiler's figures for it."""
    import importlib
    import pkgutil

    import triton

    from lockstep.backends import triton as backend

    rows = []
    for info in pkgutil.iter_modules(backend.__path__):
        module = importlib.import_module(f"{backend.__name__}.{info.name}")
        for name, fn in vars(module).items():
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                continue
            for device_cache in fn.device_caches.values():
                for key, compiled in device_cache[0].items():
                    md = compiled.metadata
                    rows.append({"kernel": name, "key": str(key), "registers": compiled.n_regs,
                                 "spills": compiled.n_spills, "shared_bytes": md.shared,
                                 "num_warps": md.num_warps, "num_stages": getattr(md, "num_stages", None),
                                 "target": str(md.target)})
    return rows


if __name__ == "__main__":
    sys.exit(main())
