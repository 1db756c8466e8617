"""Benchmark: training step time of lockstep's trainer against the plain PyTorch trainer of the
parity test (transformers Llama + torch.optim.AdamW + F.cross_entropy), same model, CPU."""

import torch

from lockstep.bench import machine
from lockstep.train import PackedDataset, TrainConfig, Trainer

from _small_model import best_of, hf_model, lockstep_model


def main():
    print(f"machine: {machine()}")
    print("| setting | lockstep ms/step | plain PyTorch ms/step | ratio |\n|---|---|---|---|")
    for seq_len, micro, accum in ((256, 1024, 1), (256, 1024, 4)):
        ours = lockstep_model(torch.float32).train()
        hf = hf_model(ours).train()
        tokens = torch.randint(0, 8192, (200_000,)).tolist()
        cfg = TrainConfig(steps=1000, seq_len=seq_len, micro_batch_tokens=micro, accum=accum, lr=1e-4)
        trainer = Trainer(ours, PackedDataset(tokens, seq_len, micro, 0), cfg)
        data = PackedDataset(tokens, seq_len, micro, 0)
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95))

        def plain():
            opt.zero_grad()
            window = [data.next_batch() for _ in range(accum)]
            n = sum(s.numel() - 1 for mb in window for s in mb)
            for mb in window:
                x = torch.stack(mb)
                logits = hf(x[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                         reduction="sum")
                (loss / n).backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            opt.step()

        t_ours, t_plain = best_of(trainer.step, 3), best_of(plain, 3)
        print(f"| {micro} tokens x accum {accum} | {t_ours * 1e3:.0f} | {t_plain * 1e3:.0f} | {t_ours / t_plain:.2f} |")


if __name__ == "__main__":
    main()
