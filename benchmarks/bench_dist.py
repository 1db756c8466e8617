"""Benchmark: layout-invariant training (docs/adr/0007) against the stock ways, on gloo and CPU.

1. Completing unit trees across data-parallel ranks (`Parallel.complete`) against one
   `all_reduce`, 1M to 100M fp32 values, 2 and 4 processes: even power-of-two shares (two-rank
   all_reduce rounds) and uneven shares (all_to_all of pieces, an owner's tree, all_gather).
2. A data-parallel training step against torch DDP (stock eager ops, torch AdamW), same model and
   tokens per rank.
3. A single-process step against the order used before unit trees (`layout_invariant=False`:
   autograd sums each micro-batch into .grad), and the memory the unit trees hold, in bytes per
   parameter.

The model is Qwen3-0.6B's shape (benchmarks/_realistic.py) with `--layers` layers (default 2).
Usage: python benchmarks/bench_dist.py [--layers N] [--parts reduce,dp,single]
"""

import argparse
import json
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from lockstep import dist as ldist
from lockstep.numerics import fixed_order
from lockstep.tools.bench import machine
from lockstep.numerics.grad_tree import UnitTrees
from lockstep.train import PackedDataset, TrainConfig, Trainer

from _realistic import best_of, lockstep_model

SEQ_LEN = 128
SEQS_PER_RANK = 2          # 256 tokens per rank and step
TOKENS = torch.randint(0, 151936, (200_000,), generator=torch.Generator().manual_seed(0)).tolist()


def _timed(fn, repeats=3):
    fn()
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _reduce_worker(rank, world, out, sizes):
    ldist.initialize_model_parallel(1)
    sync = ldist.ParallelSync(nn.Module())
    rows = []
    for n in sizes:
        row = {"n": n}
        # one unit per rank (the pair rounds), and one unit more than ranks (uneven: all_to_all)
        for path, units in (("pairs", world), ("shards", world + 1)):
            trees = UnitTrees([])
            tree = trees.trees.setdefault(("w", "linear", 0), fixed_order.TreeSum())
            start, stop = ldist.share_of(units, rank, world)
            for unit in range(start, stop):
                tree.add(unit, 1, torch.randn(n))
                trees.loss.add(unit, 1, torch.zeros(()))
            assert sync.completes_by_pairs(units) == (path == "pairs")
            row[path] = _timed(lambda: sync.complete(trees, units))
            trees = tree = None     # free before the next size
        x = torch.randn(n)
        row["all_reduce"] = _timed(lambda: dist.all_reduce(x))
        rows.append(row)
    if rank == 0:
        json.dump(rows, open(out, "w"))


def _step_worker(rank, world, out, layers, which):
    """One side per spawn: two realistic models per process do not fit 4 processes in 24 GiB."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lockstep import use_backend
    from lockstep.train import cross_entropy_sum

    ldist.initialize_model_parallel(1)
    cfg = TrainConfig(steps=100, seq_len=SEQ_LEN, micro_batch_tokens=SEQ_LEN * SEQS_PER_RANK, lr=1e-4)
    model = lockstep_model(torch.float32, layers).train()
    if which == "lockstep":
        trainer = Trainer(model, PackedDataset(TOKENS, SEQ_LEN, cfg.micro_batch_tokens, 0), cfg, ldist.ParallelSync(model))
        step = trainer.step
    else:
        ddp_model = DDP(model)
        opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-4)
        data = PackedDataset(TOKENS, SEQ_LEN, cfg.micro_batch_tokens, 0)

        def step():
            with use_backend("eager"):
                window = data.take(SEQS_PER_RANK * world)
                mine = window[rank * SEQS_PER_RANK:(rank + 1) * SEQS_PER_RANK]
                opt.zero_grad()
                loss, n = cross_entropy_sum(ddp_model.module, mine)
                (loss / (n * world)).backward()     # DDP averages over ranks: the window's token mean
                opt.step()

    seconds = _timed(step)
    if rank == 0:
        json.dump(seconds, open(out, "w"))


class _TreeBytes:
    """Peak bytes held by the pieces of every unit tree during one window (wraps TreeSum.add)."""

    def __init__(self):
        self.live, self.peak, self.by_tree = 0, 0, {}
        self._add = fixed_order.TreeSum.add

    def __enter__(self):
        meter = self

        def add(tree, start, size, value):
            meter._add(tree, start, size, value)
            now = sum(v.numel() * v.element_size() for _, _, v in tree.pieces if isinstance(v, torch.Tensor))
            meter.live += now - meter.by_tree.get(id(tree), 0)
            meter.by_tree[id(tree)] = now
            meter.peak = max(meter.peak, meter.live)

        fixed_order.TreeSum.add = add
        return self

    def __exit__(self, *exc):
        fixed_order.TreeSum.add = self._add


def single_process(layers):
    print(f"\n| one process, {SEQ_LEN}-token sequences | layout-invariant ms/step | before unit trees ms/step | ratio | "
          "unit-tree peak bytes/param |\n|---|---|---|---|---|")
    for micro, accum in ((SEQ_LEN * 4, 1), (SEQ_LEN * 2, 2), (SEQ_LEN, 4)):
        cfg = TrainConfig(steps=100, seq_len=SEQ_LEN, micro_batch_tokens=micro, accum=accum, lr=1e-4)
        steps = {}
        for invariant in (True, False):
            model = lockstep_model(torch.float32, layers).train()
            trainer = Trainer(model, PackedDataset(TOKENS, SEQ_LEN, micro, 0), cfg, layout_invariant=invariant)
            steps[invariant] = best_of(trainer.step, 2)
            if invariant:
                params = sum(p.numel() for p in model.parameters())
                with _TreeBytes() as meter:
                    trainer.step()
                per_param = meter.peak / params
        print(f"| {micro} tokens x accum {accum} | {steps[True] * 1e3:.0f} | {steps[False] * 1e3:.0f} | "
              f"{steps[True] / steps[False]:.2f} | {per_param:.1f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--parts", default="reduce,dp,single")
    args = ap.parse_args()
    parts = args.parts.split(",")
    print(f"machine: {machine()}; model: Qwen3-0.6B shape, {args.layers} layers")
    if "reduce" in parts:
        print("\n| values (fp32) | processes | all_reduce ms | pair rounds ms (even shares) | ratio | "
              "all_to_all + all_gather ms (uneven shares) | ratio |\n|---|---|---|---|---|---|---|")
        for world in (2, 4):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                ldist.spawn(_reduce_worker, world, f.name, [1_000_000, 10_000_000, 100_000_000])
                for r in json.load(open(f.name)):
                    base = r["all_reduce"]
                    print(f"| {r['n']:,} | {world} | {base * 1e3:.1f} | {r['pairs'] * 1e3:.1f} | {r['pairs'] / base:.2f} "
                          f"| {r['shards'] * 1e3:.1f} | {r['shards'] / base:.2f} |", flush=True)
    if "dp" in parts:
        print(f"\n| DP step ({SEQS_PER_RANK} x {SEQ_LEN} tokens per rank) | processes | lockstep ms | "
              "torch DDP (eager ops) ms | ratio |\n|---|---|---|---|---|")
        for world in (2, 4):
            r = {}
            for which in ("lockstep", "ddp"):
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    ldist.spawn(_step_worker, world, f.name, args.layers, which, timeout_s=1800)
                    r[which] = json.load(open(f.name))
            print(f"| train step | {world} | {r['lockstep'] * 1e3:.0f} | {r['ddp'] * 1e3:.0f} | "
                      f"{r['lockstep'] / r['ddp']:.2f} |", flush=True)
    if "single" in parts:
        single_process(args.layers)


if __name__ == "__main__":
    sys.exit(main())
