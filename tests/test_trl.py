"""TRL's GRPOTrainer (pinned in the test extra) with lockstep: zero train-inference mismatch.

A few GRPO steps of a tiny Qwen3 on CPU. lockstep.integrations.trl logs, per step, the largest
difference between a token's sampling-time logprob and the training forward's; it must be exactly 0
through either route, in fp32, with bf16 weights and under bf16=True (autocast), and it is not 0
without lockstep."""

import os
import sys
import warnings

import pytest
import torch

import trl  # noqa: F401  (in the test extra: this file must run, not skip)

from lockstep.integrations import trl as lockstep_trl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

PRECISIONS = ["fp32", "bf16-weights", "bf16=True"]


def _trainer(precision: str, rollout: bool = False, chat: bool = False):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl_grpo import tiny_model_and_tokenizer      # the example's model: the test runs what users copy

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    model, tokenizer = tiny_model_and_tokenizer()
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    prompts = [" ".join(f"w{(i * 7 + j) % 97}" for j in range(3 + i % 5)) for i in range(16)]  # left padding varies
    reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    if chat:                 # conversational prompts, rendered by the tokenizer's chat template
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w1"
        prompts = [[{"role": "user", "content": p}] for p in prompts]
        reward = lambda completions, **kw: [float(len(c[-1]["content"])) for c in completions]  # noqa: E731
    args = GRPOConfig(output_dir="/tmp/lockstep-trl-test", per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=3, learning_rate=1e-3, logging_steps=1, report_to=[],
                      use_cpu=True, save_strategy="no", temperature=0.9, bf16=precision == "bf16=True", seed=1,
                      disable_tqdm=True)
    extra = dict(rollout_func=lockstep_trl.rollout_func()) if rollout else {}
    return GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                       **extra)


def _mismatch(trainer) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    rows = [{k: r[k] for k in lockstep_trl.METRICS} for r in trainer.state.log_history if lockstep_trl.METRICS[0] in r]
    assert len(rows) == 3 and all(r["lockstep/tokens"] > 0 for r in rows), rows
    return rows


def test_packed_rows_stand_on_trls_label_grid():
    """The rollout route's packed logprobs, row by row, at the columns of labels[:, 1:] whose token has
    a next one, left or right padded; 0 outside the completion; a row with a hole is refused."""
    attention_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    completion = torch.tensor([[False, False, True], [True, False, False]])
    on_grid = lockstep_trl._on_grid(torch.tensor([1.0, 2.0, 3.0]), attention_mask, completion)
    assert on_grid.tolist() == [[0.0, 0.0, 2.0], [3.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match=r"^attention_mask: expected each row's tokens in one run, 2 of them with a "
                                         r"next token in all; got 1$"):
        lockstep_trl._on_grid(torch.tensor([1.0, 2.0]), torch.tensor([[1, 0, 1, 1]]), torch.ones(1, 3, dtype=torch.bool))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_exact_makes_generate_and_training_agree_bitwise(precision):
    trainer = _trainer(precision)
    lockstep_trl.exact(trainer)
    for row in _mismatch(trainer):
        assert row["lockstep/max_abs_dlogp"] == 0 and row["lockstep/approx_kl0"] == 0 and row["lockstep/mean_ratio"] == 1


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lockstep_engine_as_rollout_func_agrees_bitwise(precision):
    for row in _mismatch(_trainer(precision, rollout=True)):
        assert row["lockstep/max_abs_dlogp"] == 0 and row["lockstep/approx_kl0"] == 0 and row["lockstep/mean_ratio"] == 1


def test_the_rollout_func_takes_chat_prompts():
    """Conversational prompts go through the tokenizer's chat template (a BatchEncoding in
    transformers 5) to the Engine, and the agreement stays exact."""
    for row in _mismatch(_trainer("fp32", rollout=True, chat=True)):
        assert row["lockstep/max_abs_dlogp"] == 0 and row["lockstep/approx_kl0"] == 0 and row["lockstep/mean_ratio"] == 1


@pytest.mark.parametrize("precision", ["fp32", "bf16=True"])
def test_without_lockstep_the_same_run_shows_the_mismatch(precision):
    trainer = _trainer(precision)
    lockstep_trl.measure(trainer)
    assert all(row["lockstep/max_abs_dlogp"] > 0 for row in _mismatch(trainer))


def test_the_rollout_shares_the_trainers_parameters():
    trainer = _trainer("fp32")
    shared = lockstep_trl.shared_transformer(trainer.model)
    ours = dict(shared.named_parameters())
    assert all(ours[n] is p for n, p in trainer.model.named_parameters() if n in ours)
    assert set(ours) == {n for n, _ in trainer.model.named_parameters()}
