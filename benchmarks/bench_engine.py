"""Benchmark: engine throughput (generated tokens/s) at 1, 8 and 32 concurrent requests against a
plain eager generate loop (transformers generate with KV cache, greedy) of the same model, CPU."""

import time

import torch

from lockstep import Engine, SamplingParams
from lockstep.tools.bench import machine

from _small_model import hf_model, lockstep_model

NEW = 32
PROMPT = 64


def main():
    print(f"machine: {machine()}")
    print("| concurrent requests | lockstep engine tok/s | eager generate tok/s | ratio (engine / eager) |\n|---|---|---|---|")
    ours = lockstep_model(torch.float32)
    hf = hf_model(ours)
    for n in (1, 8, 32):
        prompts = torch.randint(0, 8192, (n, PROMPT))
        engine = Engine(ours, max_num_seqs=n, max_num_batched_tokens=2048, block_size=16)
        t = time.perf_counter()
        outs = engine.generate(prompts.tolist(), SamplingParams(temperature=0, max_new_tokens=NEW))
        t_engine = time.perf_counter() - t
        assert all(len(o.token_ids) == NEW for o in outs)
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW, min_new_tokens=NEW,
                        do_sample=False)
        t_hf = time.perf_counter() - t
        a, b = n * NEW / t_engine, n * NEW / t_hf
        print(f"| {n} | {a:.0f} | {b:.0f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
