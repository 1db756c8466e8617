"""The optimizer sharded over data-parallel ranks (docs/adr/0037): AdamW's state held per rank, and
the time of an optimizer step with its parameter gather, at data-parallel sizes 1 and 2 (gloo).

The model is SmolLM2-135M's shape (Llama, hidden 576, 30 layers, 9 query / 3 KV heads of 64,
intermediate 1536, vocabulary 49,152, tied embeddings) with random weights, in bf16 with fp32 master
weights, as `lockstep rl` trains it. The state bytes are those of the moment and master tensors the
rank's optimizer holds. The step's time is one AdamW step from the same random gradients on every
rank (no forward or backward), the median of `--repeats`; the parameters after it are compared
bitwise between the sharded and the replicated optimizer.

Usage: python benchmarks/bench_zero.py [--layers 30] [--repeats 3]
"""

import argparse
import json
import statistics
import tempfile
import time

import torch

from lockstep import dist as ldist
from lockstep.model import ModelConfig, Transformer, params_digest
from lockstep.tools.bench import machine
from lockstep.train import TrainConfig, Trainer

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
             tie_word_embeddings=True)


def _trainer(layers: int, shard: bool, sync) -> Trainer:
    model = Transformer.from_config(ModelConfig.tiny("llama", num_layers=layers, **SHAPE), seed=0, dtype=torch.bfloat16)
    if sync is not None:
        sync = sync(model)
    return Trainer(model, None, TrainConfig(master_weights=True, shard_optimizer=shard), sync)


def _measure(layers: int, repeats: int, sync=None) -> dict:
    """State bytes and the median step seconds of the replicated and the sharded optimizer."""
    out = {}
    for shard in (False, True):
        trainer = _trainer(layers, shard, sync)
        gen = torch.Generator().manual_seed(1)
        grads = {n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in trainer.named}
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            trainer.opt.step(1e-4, grads=grads)
            times.append(time.perf_counter() - t)
        out["sharded" if shard else "replicated"] = {
            "state_bytes": trainer.optimizer_state_bytes(), "step_s": statistics.median(times),
            "params": params_digest(trainer.named), "numel": sum(p.numel() for _, p in trainer.named)}
        del trainer, grads
    return out


def _worker(rank, world, layers, repeats, path):
    result = _measure(layers, repeats, ldist.ParallelSync)
    with open(f"{path}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)          # as each spawned rank runs
    one = _measure(args.layers, args.repeats)
    with tempfile.TemporaryDirectory() as path:
        ldist.spawn(_worker, 2, args.layers, args.repeats, path)
        two = [json.load(open(f"{path}/rank{r}.json")) for r in range(2)]
    numel = one["replicated"]["numel"]
    print(f"# SmolLM2-135M shape, {args.layers} layers, {numel / 1e6:.1f}M parameters, bf16 + fp32 master weights; "
          f"{machine()}")
    print("| data-parallel size | optimizer | rank | state bytes | bytes / parameter | step (s) |")
    print("|---|---|---|---:|---:|---:|")
    for dp, ranks in ((1, [one]), (2, two)):
        for kind in ("replicated", "sharded"):
            for r, res in enumerate(ranks):
                b = res[kind]["state_bytes"]
                print(f"| {dp} | {kind} | {r} | {b:,} ({b / 2**20:.1f} MiB) | {b / numel:.2f} | "
                      f"{res[kind]['step_s']:.3f} |")
    same = {res[kind]["params"] for res in [one, *two] for kind in ("replicated", "sharded")}
    print(f"parameters after the step: {'bitwise the same' if len(same) == 1 else 'DIFFERENT'} in all "
          f"{2 * 3} runs")


if __name__ == "__main__":
    main()
