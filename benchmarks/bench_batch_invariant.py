"""Benchmark: a transformers Llama, unmodified vs lockstep.patch(model) vs inside
lockstep.batch_invariant(): a 512-token forward and 32 greedy decode steps, CPU."""

import torch

import lockstep
from lockstep.tools.bench import machine

from _small_model import best_of, hf_model, lockstep_model


def main():
    print(f"machine: {machine()}")
    print("| what | dtype | unmodified ms | patched ms | ratio | mode ms | ratio |\n|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        hf = hf_model(lockstep_model(dtype))
        hf.config._attn_implementation = "sdpa"
        ids = torch.randint(0, 8192, (1, 512))

        def forward():
            with torch.no_grad():
                hf(ids)

        def decode():
            with torch.no_grad():
                hf.generate(ids[:, :64], attention_mask=torch.ones_like(ids[:, :64]), max_new_tokens=32,
                            min_new_tokens=32, do_sample=False)

        for name, fn in (("forward 512 tokens", forward), ("64-token prompt + 32 decode steps", decode)):
            base = best_of(fn, 2)
            lockstep.patch(hf)
            patched = best_of(fn, 2)
            lockstep.unpatch(hf)
            with lockstep.batch_invariant():
                mode = best_of(fn, 2)
            print(f"| {name} | {str(dtype)[6:]} | {base * 1e3:.0f} | {patched * 1e3:.0f} | {patched / base:.2f} | "
                  f"{mode * 1e3:.0f} | {mode / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
