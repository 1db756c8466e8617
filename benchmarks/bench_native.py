"""Benchmark: the native CPU GEMM against the portable backend's (PyTorch's BLAS in fixed tiles) and
stock PyTorch (`x @ w.T`), at Qwen3-0.6B's linear shapes (K = 1024; N = 3072 and the 151,936-row LM
head), M = 1, 8, 128 and 512 rows, and the issue's prefill shapes (2048 rows against N = 3072 and
1024), bf16 and fp32, in one run. Ratios above 1: native is slower; the prefill target (at least
70% of torch.mm's throughput) is native / stock at most 1.43.

Usage: python benchmarks/bench_native.py"""

import torch

from lockstep.backends.native import build, gemm
from lockstep.tools.bench import machine
from lockstep.numerics.fixed_order import torch_matmul_rows

from _realistic import best_of


def best_ms(fn, repeats: int) -> float:
    return best_of(fn, repeats) * 1e3


def main() -> None:
    print(f"machine: {machine()}, native ISA {build.isa_name()}")
    print("| dtype | M x N x K | native ms | portable ms | stock ms | native / portable | native / stock |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        shapes = [(m, n) for n in (3072, 151936) for m in (1, 8, 128, 512) if n < 100000 or m <= 128]
        for m, n in shapes + [(2048, 3072), (2048, 1024)]:
            x, w = torch.randn(m, 1024).to(dtype), (torch.randn(n, 1024) / 32).to(dtype)
            reps = 3 if n > 100000 or m >= 2048 else 10
            nat = best_ms(lambda: gemm.matmul_rows(x, w.t()), reps)
            por = best_ms(lambda: torch_matmul_rows(x, w.t()), reps)
            sto = best_ms(lambda: x @ w.t(), reps)
            print(f"| {str(dtype)[6:]} | {m} x {n} x 1024 | {nat:.2f} | {por:.2f} | {sto:.2f} | {nat / por:.2f} | "
                  f"{nat / sto:.2f} |", flush=True)

if __name__ == "__main__":
    main()
