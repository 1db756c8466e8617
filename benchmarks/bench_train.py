"""Benchmark: training step time of lockstep's trainer against the plain PyTorch trainer of the
parity test (transformers Llama + torch.optim.AdamW + F.cross_entropy), same model, CPU."""

import torch

from lockstep.tools.bench import machine
from lockstep.parity import PlainTrainer
from lockstep.train import PackedDataset, TrainConfig, Trainer

from _small_model import best_of, lockstep_model


def main():
    print(f"machine: {machine()}")
    print("| setting | lockstep ms/step | plain PyTorch ms/step | ratio |\n|---|---|---|---|")
    for seq_len, micro, accum in ((256, 1024, 1), (256, 1024, 4)):
        ours = lockstep_model(torch.float32).train()
        tokens = torch.randint(0, 8192, (200_000,)).tolist()
        cfg = TrainConfig(steps=1000, seq_len=seq_len, micro_batch_tokens=micro, accum=accum, lr=1e-4)
        plain = PlainTrainer(ours, cfg)                 # copies the weights before lockstep trains
        trainer = Trainer(ours, PackedDataset(tokens, seq_len, micro, 0), cfg)
        data = PackedDataset(tokens, seq_len, micro, 0)
        t_ours = best_of(trainer.step, 3)
        t_plain = best_of(lambda: plain.step([data.next_batch() for _ in range(accum)]), 3)
        print(f"| {micro} tokens x accum {accum} | {t_ours * 1e3:.0f} | {t_plain * 1e3:.0f} | {t_ours / t_plain:.2f} |")


if __name__ == "__main__":
    main()
