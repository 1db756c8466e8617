"""Benchmark at Qwen3-0.6B's shape (benchmarks/_realistic.py, 4 layers on CPU): lockstep end to end
against stock PyTorch/transformers on the same weights, in the same run.

- engine: `Engine.generate` throughput against transformers `generate` (sdpa, greedy), 1, 8 and 32
  requests of 128 prompt + 16 new tokens, bf16 and fp32;
- mode: `lockstep.batch_invariant()` around transformers `generate` (1 and 8 requests) and around a
  training forward + backward of 1024 tokens, against the same calls outside it;
- train: a lockstep training step (forward, backward, AdamW; 8 sequences of 128 tokens, or
  --train-seqs sequences of --seq tokens) against transformers with torch.optim.AdamW; and the
  forward + backward alone.

Each row is one ratio, lockstep time / stock time (for throughput: stock / lockstep, so that above
1 is slower everywhere). Usage: python benchmarks/bench_realistic.py [--parts engine,mode,train]
[--dtypes bf16,fp32] [--seq 128] [--train-seqs 8]
"""

import argparse
import time

import torch

import lockstep
from lockstep import Engine, SamplingParams
from lockstep.tools.bench import machine
from lockstep.model import packed_logprobs
from lockstep.train import PackedDataset, TrainConfig, Trainer

from _realistic import LAYERS, best_of, hf_model, lockstep_model

PROMPT, NEW, SEQ, TRAIN_SEQS = 128, 16, 128, 8
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VOCAB = 151936


def _prompts(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, PROMPT), generator=torch.Generator().manual_seed(n))


def _hf_generate(hf, prompts: torch.Tensor) -> None:
    with torch.no_grad():
        hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW, min_new_tokens=NEW,
                    do_sample=False)


def _row(work: str, dtype: str, ours: float, stock: float) -> None:
    print(f"| {work} | {dtype} | {ours * 1e3:.0f} | {stock * 1e3:.0f} | {ours / stock:.2f} |", flush=True)


def engine_rows(dtype_name: str) -> None:
    ours = lockstep_model(DTYPES[dtype_name])
    hf = hf_model(ours)
    for n in (1, 8, 32):
        prompts = _prompts(n)

        def engine():
            e = Engine(ours, max_num_seqs=n, max_num_batched_tokens=4096, block_size=16)
            outs = e.generate(prompts.tolist(), SamplingParams(temperature=0, max_new_tokens=NEW))
            assert all(len(o.token_ids) == NEW for o in outs)

        repeats = 2 if n < 32 else 1
        _row(f"Engine.generate vs transformers generate, {n} request(s)", dtype_name,
             best_of(engine, repeats), best_of(lambda: _hf_generate(hf, prompts), repeats))


def _hf_backward(hf, ids: torch.Tensor) -> None:
    """transformers' forward and backward of the mean token cross-entropy of ids [B, T + 1]."""
    logits = hf(ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)).backward()


def _hf_forward_backward(hf, ids: torch.Tensor) -> None:
    _hf_backward(hf, ids)
    hf.zero_grad(set_to_none=True)


def mode_rows(dtype_name: str) -> None:
    hf = hf_model(lockstep_model(DTYPES[dtype_name]))
    for n in (1, 8):
        prompts = _prompts(n)
        stock = best_of(lambda: _hf_generate(hf, prompts), 2)
        with lockstep.batch_invariant():
            mode = best_of(lambda: _hf_generate(hf, prompts), 2)
        _row(f"batch_invariant() around generate, {n} request(s)", dtype_name, mode, stock)
    ids = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    hf.train()
    stock = best_of(lambda: _hf_forward_backward(hf, ids), 2)
    with lockstep.batch_invariant():
        mode = best_of(lambda: _hf_forward_backward(hf, ids), 2)
    _row(f"batch_invariant() around forward + backward, {8 * SEQ} tokens", dtype_name, mode, stock)


def train_rows(dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    ours = lockstep_model(dtype).train()
    hf = hf_model(ours).train()
    tokens = torch.randint(0, VOCAB, (100_000,), generator=torch.Generator().manual_seed(2)).tolist()
    ids = torch.tensor(tokens[:TRAIN_SEQS * (SEQ + 1)]).view(TRAIN_SEQS, SEQ + 1)

    def ours_forward_backward():
        lp, _ = packed_logprobs(ours, list(ids.unbind(0)))
        (-lp.sum() / lp.numel()).backward()
        ours.zero_grad(set_to_none=True)

    _row(f"training forward + backward, {TRAIN_SEQS} x {SEQ} tokens", dtype_name,
         best_of(ours_forward_backward, 2), best_of(lambda: _hf_forward_backward(hf, ids), 2))
    cfg = TrainConfig(steps=100, seq_len=SEQ + 1, micro_batch_tokens=TRAIN_SEQS * (SEQ + 1), lr=1e-5,
                      master_weights=dtype != torch.float32)
    trainer = Trainer(ours, PackedDataset(tokens, cfg.seq_len, cfg.micro_batch_tokens, 0), cfg)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)

    def stock_step():
        _hf_backward(hf, ids)
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _row(f"training step (forward, backward, AdamW), {TRAIN_SEQS} x {SEQ} tokens", dtype_name,
         best_of(trainer.step, 2), best_of(stock_step, 2))


def main():
    global SEQ, TRAIN_SEQS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="engine,mode,train")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per training sequence (train and mode parts)")
    ap.add_argument("--train-seqs", type=int, default=TRAIN_SEQS, help="training sequences per step (train part)")
    args = ap.parse_args()
    SEQ, TRAIN_SEQS = args.seq, args.train_seqs
    torch.manual_seed(0)
    print(f"machine: {machine()}; Qwen3-0.6B shape with {LAYERS} layers, {torch.get_num_threads()} threads")
    print("| work | dtype | lockstep ms | stock ms | ratio |\n|---|---|---|---|---|")
    for part, rows in (("engine", engine_rows), ("mode", mode_rows), ("train", train_rows)):
        if part in args.parts.split(","):
            for dtype_name in args.dtypes.split(","):
                t = time.perf_counter()
                rows(dtype_name)
                print(f"<!-- {part} {dtype_name}: {time.perf_counter() - t:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
