"""Benchmark: lockstep's fixed-order gradient reduction against torch.distributed.all_reduce on gloo
(1M to 100M fp32 values, 2 and 4 processes), and a data-parallel training step against torch DDP."""

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from lockstep import dist as ldist
from lockstep.bench import machine


def _reduce_worker(rank, world, out, sizes):
    rows = []
    for n in sizes:
        p = nn.Parameter(torch.zeros(n))
        p.grad = torch.randn(n)
        reducer = ldist.GradReducer([("p", p)], bucket_numel=1 << 22)
        x = torch.randn(n)
        times = {"lockstep": [], "all_reduce": []}
        for _ in range(3):
            p.grad = torch.randn(n)
            dist.barrier()
            t = time.perf_counter()
            reducer.finish()
            times["lockstep"].append(time.perf_counter() - t)
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            times["all_reduce"].append(time.perf_counter() - t)
        rows.append({"n": n, **{k: min(v) for k, v in times.items()}})
    if rank == 0:
        json.dump(rows, open(out, "w"))


def _step_worker(rank, world, out):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lockstep.model import ModelConfig, Transformer
    from lockstep.train import PackedDataset, TrainConfig, Trainer

    cfg = TrainConfig(steps=100, seq_len=128, micro_batch_tokens=512, lr=1e-4)
    tokens = torch.randint(0, 8192, (100_000,), generator=torch.Generator().manual_seed(0)).tolist()
    make = lambda: Transformer.from_config(ModelConfig.tiny("llama", vocab_size=8192, hidden_size=256,  # noqa: E731
                                                            intermediate_size=704, num_layers=4, head_dim=64), seed=0)
    dp = ldist.DataParallelTrainer(Trainer(make(), PackedDataset(tokens, 128, 512, 0), cfg))
    ddp_model = DDP(make())
    opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-4)
    data = PackedDataset(tokens, 128, 512, 0)

    def ddp_step():
        from lockstep import use_backend
        from lockstep.train import cross_entropy_sum
        with use_backend("eager"):
            window = [data.next_batch() for _ in range(world)]
            mb = window[rank]
            opt.zero_grad()
            loss, n = cross_entropy_sum(ddp_model.module, mb)
            (loss / (n * world)).backward()     # DDP averages: scale like lockstep's window mean
            opt.step()

    def best(fn):
        fn()
        ts = []
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    res = {"lockstep": best(dp.step), "ddp": best(ddp_step)}
    if rank == 0:
        json.dump(res, open(out, "w"))


def main():
    print(f"machine: {machine()}")
    print("| values (fp32) | processes | lockstep reduce ms | all_reduce ms | ratio |\n|---|---|---|---|---|")
    for world in (2, 4):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            ldist.spawn(_reduce_worker, world, f.name, [1_000_000, 10_000_000, 100_000_000])
            for r in json.load(open(f.name)):
                print(f"| {r['n']:,} | {world} | {r['lockstep'] * 1e3:.1f} | {r['all_reduce'] * 1e3:.1f} | "
                      f"{r['lockstep'] / r['all_reduce']:.2f} |", flush=True)
    print("\n| DP step (small Llama, 512 tokens per rank) | processes | lockstep ms | torch DDP (eager ops) ms | ratio |")
    print("|---|---|---|---|---|")
    for world in (2, 4):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            ldist.spawn(_step_worker, world, f.name)
            r = json.load(open(f.name))
            print(f"| train step | {world} | {r['lockstep'] * 1e3:.0f} | {r['ddp'] * 1e3:.0f} | "
                  f"{r['lockstep'] / r['ddp']:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
