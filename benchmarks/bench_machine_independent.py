"""Benchmark: what machine-independent arithmetic costs (docs/adr/0021, its later section), each
against the PyTorch call it replaces, in one run on 2 threads:

- an AdamW step over the realistic model's parameter count in fp32, its denominator's root on the
  native kernels against torch.sqrt (MKL's vector math), and torch.optim.AdamW for scale;
- `Transformer.from_config` of the realistic model (exact_math.normal) against torch.randn of as
  many values, the draws alone.
"""

import time

import torch

from lockstep.numerics import fixed_order
from lockstep.tools.bench import machine
from lockstep.train import optim
from lockstep.train.optim import AdamW, AdamWConfig

from _realistic import best_of, lockstep_model


def main():
    torch.set_num_threads(2)
    print(f"machine: {machine()}")
    t = time.perf_counter()
    model = lockstep_model(torch.float32)
    drawn_s = time.perf_counter() - t
    n = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    randn_s = best_of(lambda: torch.randn(n, generator=gen), repeats=1)

    params = [(name, p) for name, p in model.named_parameters()]
    for _, p in params:
        p.grad = torch.full_like(p, 1e-3)
    ours = AdamW(params, AdamWConfig(1e-4, (0.9, 0.95), 1e-8, 0.1))
    native_ms = best_of(lambda: ours.step(1e-4), repeats=5) * 1e3
    optim.sqrt = lambda x, out=None: torch.sqrt(x, out=out)           # the root before the change
    try:
        torch_ms = best_of(lambda: ours.step(1e-4), repeats=5) * 1e3
    finally:
        optim.sqrt = fixed_order.sqrt
    stock = torch.optim.AdamW([p for _, p in params], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    stock_ms = best_of(stock.step, repeats=5) * 1e3

    print(f"\n{n / 1e6:.0f}M fp32 parameters (the realistic model, 4 layers)\n")
    print("| work | lockstep | replaced call | ratio |\n|---|---|---|---|")
    print(f"| AdamW step | {native_ms:.0f} ms (native root) | {torch_ms:.0f} ms (torch.sqrt) | "
          f"{native_ms / torch_ms:.2f} |")
    print(f"| | | {stock_ms:.0f} ms (torch.optim.AdamW) | {native_ms / stock_ms:.2f} |")
    print(f"| random weights | {drawn_s:.2f} s (from_config, model built too) | {randn_s:.2f} s (torch.randn, "
          f"draws alone) | {drawn_s / randn_s:.1f} |")


if __name__ == "__main__":
    main()
