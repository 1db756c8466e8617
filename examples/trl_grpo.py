"""GRPO with TRL's GRPOTrainer and lockstep on CPU, with the per-step mismatch between
sampling-time and training logprobs printed.

    python examples/trl_grpo.py --route exact      # transformers' generate samples, lockstep computes
    python examples/trl_grpo.py --route rollout    # lockstep's Engine samples (TRL's rollout_func)
    python examples/trl_grpo.py --route none       # stock TRL, measured: the mismatch is not 0
    ... --bf16                                     # TRL's bf16=True (autocast), fp32 weights
    ... --model smollm2                            # SmolLM2-135M-Instruct on lockstep rl's arithmetic
                                                   # word problems (exact-match reward), not a tiny Qwen3

The lockstep lines are the two marked below; the rest is an ordinary TRL script.
"""

import argparse
import os
import random
import tempfile
import warnings

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config
from trl import GRPOConfig, GRPOTrainer

from lockstep.integrations import trl as lockstep_trl
from lockstep.rl.task import ArithmeticTask, parse_answer


def tiny_model_and_tokenizer():
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(97)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=1)
    return AutoModelForCausalLM.from_config(config), tokenizer


def tiny_task():
    """Prompts of word ids, and a reward for long completions: enough to exercise the loop."""
    prompts = [" ".join(f"w{(i * 7 + j) % 97}" for j in range(3 + i % 5)) for i in range(32)]
    return Dataset.from_dict({"prompt": prompts}), lambda completions, **kw: [float(len(c)) for c in completions]


def smollm2_model_and_tokenizer():
    """SmolLM2-135M-Instruct from the installed GGUF file, converted once to an HF folder."""
    from lockstep.model import convert_gguf, smollm2_path

    folder = os.path.join(tempfile.gettempdir(), "lockstep-smollm2-hf")
    if not os.path.exists(os.path.join(folder, "config.json")):
        convert_gguf(smollm2_path(), folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


def arithmetic_task():
    """lockstep rl's word problems as chat prompts, rewarded 1 when the completion's last number is
    the answer (TRL passes the dataset's `answer` column to the reward function)."""
    problems = ArithmeticTask().problems(64, random.Random(0))

    def reward(completions, answer, **kw):
        return [1.0 if parse_answer(c[-1]["content"]) == a else 0.0 for c, a in zip(completions, answer)]

    return Dataset.from_dict({"prompt": [p.messages for p in problems], "answer": [p.answer for p in problems]}), reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--route", choices=["exact", "rollout", "none"], default="exact")
    parser.add_argument("--bf16", action="store_true", help="TRL's bf16=True")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    args = parser.parse_args()
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    warnings.filterwarnings("ignore")

    real = args.model == "smollm2"
    model, tokenizer = smollm2_model_and_tokenizer() if real else tiny_model_and_tokenizer()
    dataset, reward = arithmetic_task() if real else tiny_task()
    config = GRPOConfig(output_dir=os.path.join(tempfile.gettempdir(), "lockstep-trl-example"),
                        per_device_train_batch_size=8 if real else 4, num_generations=4,
                        max_completion_length=24 if real else 8, max_steps=args.steps,
                        learning_rate=1e-5 if real else 1e-3, logging_steps=1, report_to=[], use_cpu=True,
                        save_strategy="no", temperature=1.0 if real else 0.9, bf16=args.bf16, disable_tqdm=True)
    rollout = dict(rollout_func=lockstep_trl.rollout_func()) if args.route == "rollout" else {}   # lockstep, route 2
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, **rollout)
    if args.route == "exact":
        lockstep_trl.exact(trainer)                                                                # lockstep, route 1
    elif args.route == "none":
        lockstep_trl.measure(trainer)
    trainer.train()
    for rec in trainer.state.log_history:
        if "lockstep/max_abs_dlogp" in rec:
            print(f"step {rec['step']}: reward {rec.get('reward', float('nan')):.3f}, max |dlogp| "
                  f"{rec['lockstep/max_abs_dlogp']:.3g}, approx KL {rec['lockstep/approx_kl0']:.3g}, "
                  f"mean ratio {rec['lockstep/mean_ratio']:.9f}")


if __name__ == "__main__":
    main()
