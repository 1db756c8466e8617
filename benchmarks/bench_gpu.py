"""GPU benchmark of the Triton backend against cuBLAS / PyTorch / SDPA (needs a CUDA device).

bf16 linear for M in {1, 16, 128, 512, 2048, 8192} and (N, K) in {(4096, 4096), (14336, 4096),
(4096, 14336)}, forward and backward; rms_norm; selected_logprobs at a 152k vocabulary; attention
prefill (2k-8k) and decode over 4k cached keys. Reports time ratios measured in the same run
(ratio < 1: lockstep faster) and, for linear, throughput relative to cuBLAS."""

import sys

import torch

import lockstep
from lockstep import ops


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
