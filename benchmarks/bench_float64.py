"""Benchmark: float64 on the native backend (docs/adr/0027) against the PyTorch calls it replaced,
in one run on 2 threads: linear at Qwen3-0.6B's MLP shape (rows x 3072 x 1024) against
torch.nn.functional.linear in float64 (MKL's DGEMM), and exp and log over 2^20 values against
torch.exp and torch.log (MKL's vector math). float64 is not a speed target; this says what its
machine-independent bits cost."""

import torch

from lockstep.numerics import fixed_order
from lockstep import ops
from lockstep.backends.native.cpu import KERNELS
from lockstep.tools.bench import machine
from lockstep.registry import use_backend

from _realistic import best_of


def main():
    torch.set_num_threads(2)
    print(f"machine: {machine()}\n")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 1024, generator=gen, dtype=torch.float64)
    print("| work | native ms | PyTorch ms | native / PyTorch |\n|---|---|---|---|")
    for rows in (1, 128, 2048):
        x = torch.randn(rows, 1024, generator=gen, dtype=torch.float64)
        with use_backend("native"):
            native = best_of(lambda: ops.linear(x, w, None), repeats=5)
        stock = best_of(lambda: torch.nn.functional.linear(x, w), repeats=5)
        print(f"| linear {rows} x 3072 x 1024 | {native * 1e3:.2f} | {stock * 1e3:.2f} | {native / stock:.2f} |")
    x = torch.randn(1 << 20, generator=gen, dtype=torch.float64)
    for name, ours, theirs, arg in (("exp", fixed_order.exp, torch.exp, x),
                                    ("log", fixed_order.log, torch.log, x.abs())):
        native = best_of(lambda: ours(arg, kernels=KERNELS), repeats=5)
        stock = best_of(lambda: theirs(arg), repeats=5)
        print(f"| {name}, 2^20 values | {native * 1e3:.2f} | {stock * 1e3:.2f} | {native / stock:.2f} |")


if __name__ == "__main__":
    main()
