"""Benchmark: lockstep model forward (2k tokens) and decode steps against transformers eager, CPU."""

import torch

from lockstep.tools.bench import machine
from lockstep.model import CacheStep

from _small_model import best_of, hf_model, lockstep_model


def main():
    print(f"machine: {machine()}")
    print("| what | dtype | lockstep ms | transformers ms | ratio |\n|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        ours = lockstep_model(dtype)
        hf = hf_model(ours)
        ids = torch.randint(0, 8192, (2048,))
        with torch.no_grad():
            t_ours = best_of(lambda: ours(ids, torch.tensor([0, 2048])))
            t_hf = best_of(lambda: hf.model(ids[None]))
        print(f"| forward 2048 tokens | {str(dtype)[6:]} | {t_ours * 1e3:.1f} | {t_hf * 1e3:.1f} | {t_ours / t_hf:.2f} |")
        # 32 decode steps after a 512-token prompt, batch 1
        prompt = ids[:512]

        def ours_decode():
            cache = ours.allocate_kv_cache(40, 16)
            table = torch.arange(40)[None]
            with torch.no_grad():
                n = 512
                step = CacheStep(torch.tensor([0, n]), torch.tensor([n]), table, torch.arange(n))
                h = ours.forward_cached(prompt, torch.arange(n), step, cache)
                tok = int(torch.argmax(ours.lm_head_weight @ h[-1]))
                for i in range(32):
                    pos = n + i
                    step = CacheStep(torch.tensor([0, 1]), torch.tensor([pos + 1]), table, torch.tensor([pos]))
                    h = ours.forward_cached(torch.tensor([tok]), torch.tensor([pos]), step, cache)
                    tok = int(torch.argmax(ours.lm_head_weight @ h[-1]))

        def hf_decode():
            with torch.no_grad():
                hf.generate(prompt[None], max_new_tokens=33, min_new_tokens=33, do_sample=False)

        t_ours, t_hf = best_of(ours_decode, 2), best_of(hf_decode, 2)
        print(f"| 512-token prefill + 32 decode steps | {str(dtype)[6:]} | {t_ours * 1e3:.1f} | {t_hf * 1e3:.1f} | "
              f"{t_ours / t_hf:.2f} |")


if __name__ == "__main__":
    main()
