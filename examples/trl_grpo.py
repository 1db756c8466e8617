"""GRPO with TRL's GRPOTrainer and lockstep: a few steps of a tiny Qwen3 on CPU, with the per-step
mismatch between sampling-time and training logprobs printed.

    python examples/trl_grpo.py --route exact      # transformers' generate samples, lockstep computes
    python examples/trl_grpo.py --route rollout    # lockstep's Engine samples (TRL's rollout_func)
    python examples/trl_grpo.py --route none       # stock TRL, measured: the mismatch is not 0
    ... --bf16                                     # TRL's bf16=True (autocast), fp32 weights

The lockstep lines are the two marked below; the rest is an ordinary TRL script.
"""

import argparse
import os
import warnings

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
from trl import GRPOConfig, GRPOTrainer

from lockstep.integrations import trl as lockstep_trl


def tiny_model_and_tokenizer():
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(97)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=1)
    return AutoModelForCausalLM.from_config(config), tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--route", choices=["exact", "rollout", "none"], default="exact")
    parser.add_argument("--bf16", action="store_true", help="TRL's bf16=True")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    warnings.filterwarnings("ignore")

    model, tokenizer = tiny_model_and_tokenizer()
    prompts = [" ".join(f"w{(i * 7 + j) % 97}" for j in range(3 + i % 5)) for i in range(32)]
    config = GRPOConfig(output_dir="/tmp/lockstep-trl-example", per_device_train_batch_size=4, num_generations=4,
                        max_completion_length=8, max_steps=args.steps, learning_rate=1e-3, logging_steps=1,
                        report_to=[], use_cpu=True, save_strategy="no", temperature=0.9, bf16=args.bf16,
                        disable_tqdm=True)
    rollout = dict(rollout_func=lockstep_trl.rollout_func()) if args.route == "rollout" else {}   # lockstep, route 2
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=config, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=tokenizer, **rollout)
    if args.route == "exact":
        lockstep_trl.exact(trainer)                                                                # lockstep, route 1
    elif args.route == "none":
        lockstep_trl.measure(trainer)
    trainer.train()
    for rec in trainer.state.log_history:
        if "lockstep/max_abs_dlogp" in rec:
            print(f"step {rec['step']}: max |dlogp| {rec['lockstep/max_abs_dlogp']:.3g}, "
                  f"approx KL {rec['lockstep/approx_kl0']:.3g}, mean ratio {rec['lockstep/mean_ratio']:.9f}")


if __name__ == "__main__":
    main()
