"""The host work around the kernels: a decode step's time per layer, lockstep's Engine against
transformers `generate`, on models so narrow that their arithmetic costs next to nothing (hidden
64, 4 query and 2 KV heads of 16, a vocabulary of 300), so that what is left is the host's work
per layer: Python, dispatch and the kernels' call paths.

Host time per layer-step is the slope of a decode step's time between a 4-layer and a 12-layer model
of one family, 4 rows decoding (the median of 24 steps per depth), with the engine's decode steps
replayed (engine/step_graph.py, the default) and run eagerly (cpu_graphs=False). transformers' decode step is
the slope of `generate`'s time over the tokens it draws (greedy, 4 left-padded rows, its cache).
Also counted, per decode step of the 12-layer model: reads of tensor data back to the host and
non-view aten ops (lockstep.tools.host_work).

Each figure is the median of several rounds, lockstep's and transformers' measurements alternating
within each, with the rounds' lowest and highest ratio: on a shared VM one run's slope can be off
by 2x.

Usage: python benchmarks/bench_host.py [--families llama,qwen3] [--rounds 5]
"""

import argparse
import statistics
import time

import torch

from lockstep import Engine, SamplingParams
from lockstep.model import ModelConfig, Transformer
from lockstep.tools.batch_experiment import left_padded, transformers_model
from lockstep.tools.bench import machine
from lockstep.tools.host_work import HostWork

ROWS, STEPS, DEPTHS, ROUNDS = 4, 24, (4, 12), 5
PROMPTS = [[1 + i, 7, 3, 9, 4, 2, 8, 5] for i in range(ROWS)]


def _model(family: str, layers: int) -> Transformer:
    return Transformer.from_config(ModelConfig.tiny(family, num_layers=layers, hidden_size=64, num_heads=4,
                                                    num_kv_heads=2, head_dim=16, intermediate_size=160,
                                                    vocab_size=300))


def engine_step(model: Transformer, cpu_graphs: bool = True) -> tuple[float, HostWork]:
    """The median decode step's seconds, and one decode step's host work; with cpu_graphs, the
    steps after each bucket's first two are replays (engine/step_graph.py)."""
    engine = Engine(model, max_num_seqs=ROWS, block_size=16, cpu_graphs=cpu_graphs)
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=STEPS + 4))
    engine.step()                               # the prompts
    engine.step()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    with HostWork() as work:
        engine.step()
    return statistics.median(times), work


def transformers_step(hf) -> float:
    """generate's seconds per drawn token over 4 rows: the slope between 1 and STEPS + 1 new tokens
    (hf: the transformers model of a lockstep one, `transformers_model`)."""
    ids, mask = left_padded(PROMPTS, 0)

    def run(new: int) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            with torch.no_grad():
                hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=0)
            best = min(best, time.perf_counter() - start)
        return best

    return (run(STEPS + 1) - run(1)) / STEPS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="llama,qwen3")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternating rounds of both (default %(default)s)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    print(f"machine: {machine()}; {ROWS} rows decoding; the median of {args.rounds} alternating rounds")
    print("| family | lockstep us / layer-step: replayed (eager) | transformers us / layer-step | the rounds' ratio, "
          "replayed: median (min-max) | eager | reads / step | ops / layer-step, eager |")
    print("|---|---|---|---|---|---|---|")
    span = DEPTHS[1] - DEPTHS[0]
    for family in args.families.split(","):
        models = {layers: _model(family, layers) for layers in DEPTHS}
        hf = {layers: transformers_model(model, torch.float32) for layers, model in models.items()}
        rounds, works = [], {}
        # lockstep and transformers alternate, round after round, so that a slower spell of a shared
        # machine falls on both; each round's ratio is of two slopes measured minutes apart at most.
        for _ in range(args.rounds):
            ours, eager, stock = {}, {}, {}
            for layers in DEPTHS:
                ours[layers], _ = engine_step(models[layers])
                eager[layers], works[layers] = engine_step(models[layers], cpu_graphs=False)
                stock[layers] = transformers_step(hf[layers])
            lock, slow, base = ((d[DEPTHS[1]] - d[DEPTHS[0]]) / span * 1e6 for d in (ours, eager, stock))
            rounds.append((lock, slow, base, lock / base, slow / base))
        lock, slow, base, ratio, eager_ratio = (statistics.median(r[i] for r in rounds) for i in range(5))
        low, high = min(r[3] for r in rounds), max(r[3] for r in rounds)
        ops = (works[DEPTHS[1]].total_ops - works[DEPTHS[0]].total_ops) / span
        print(f"| {family} | {lock:.0f} ({slow:.0f}) | {base:.0f} | {ratio:.2f} ({low:.2f}-{high:.2f}) | "
              f"{eager_ratio:.2f} | {works[DEPTHS[1]].total_reads} | {ops:.1f} |", flush=True)


if __name__ == "__main__":
    main()
