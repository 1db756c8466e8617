"""lockstep.rl: GRPO's update through the Trainer (layout-invariant on RL batches of uneven
completion lengths), the sampler's logprobs equal to the trainer's, and the task's rewards.
The loop over a real `lockstep serve` is in tests/test_rl_loop.py."""

import dataclasses
import json
import random

import pytest
import torch

from lockstep import dist as ldist
from lockstep.engine import Engine
from lockstep.model import ModelConfig, Transformer
from lockstep.rl import RLConfig, group_advantages, rollout_window
from lockstep.rl.rollout import Rollout
from lockstep.rl.task import ArithmeticTask, Problem, check_problem, evaluate, parse_answer
from lockstep.sampling import SamplingParams
from lockstep.train import PolicyLoss, TrainConfig, Trainer

VOCAB = 300


def _model(dtype=torch.float32) -> Transformer:
    return Transformer.from_config(ModelConfig.tiny("qwen3", vocab_size=VOCAB), seed=0, dtype=dtype)


def _rl_window(seed=0, kl=False, mean="token"):
    """8 rollouts of uneven prompt and completion lengths, sampler logprobs far off the trainer's (so
    ratios leave the clip range), and mixed advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (4,), generator=g)]
    rollouts = []
    for k in range(8):
        n = int(torch.randint(1, 7, (1,), generator=g))
        lps = (-torch.rand(n, generator=g) * 3).tolist()
        rollouts.append(Rollout(k // 2, torch.randint(0, VOCAB, (n,), generator=g).tolist(), lps, "", "length", "0"))
    advantages = group_advantages([float(k % 3 == 0) for k in range(8)], 2)
    seqs, masks, loss = rollout_window(prompts, rollouts, advantages, RLConfig(loss_mean=mean, clip=0.2))
    if kl:
        loss.ref_logprobs = [torch.randn(s.numel() - 1, generator=g) - 2 for s in seqs]
        loss.kl_coef = 0.05
    return seqs, masks, loss


def _step(mb_tokens: int, window, sync=None, dtype=torch.float32) -> tuple[str, float]:
    seqs, masks, loss = window
    cfg = TrainConfig(steps=2, seq_len=2, micro_batch_tokens=mb_tokens, lr=1e-2, warmup=0, min_lr_ratio=1.0,
                      master_weights=dtype != torch.float32)
    trainer = Trainer(_model(dtype), None, cfg, sync)
    rec = trainer.step(seqs, masks, loss)
    trainer.step(seqs, masks, loss)
    return trainer.params_digest(), rec["loss"]


@pytest.mark.parametrize("kl, mean", [(False, "token"), (True, "sequence")])
def test_grpo_update_is_the_same_at_every_micro_batch_size(kl, mean):
    window = _rl_window(kl=kl, mean=mean)
    runs = {mb: _step(mb, window) for mb in (1, 20, 40, 4096)}    # 1, ~2, ~4 and 8 sequences a micro-batch
    assert len(set(runs.values())) == 1, runs
    # The policy loss is not the cross entropy: the same window trained on CE gives other weights.
    seqs, masks, _ = window
    assert _step(4096, (seqs, masks, None))[0] != runs[1][0]


def test_grpo_update_is_the_same_in_bf16_at_every_micro_batch_size():
    window = _rl_window(seed=1)
    assert len({_step(mb, window, dtype=torch.bfloat16) for mb in (1, 40, 4096)}) == 1


def _dp_worker(rank, world, out):
    digest, loss = _step(20, _rl_window(kl=True), ldist.ParallelSync(_model()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump([digest, loss], f)


def test_grpo_update_is_the_same_at_data_parallel_2(tmp_path):
    out = tmp_path / "dp2.json"
    ldist.spawn(_dp_worker, 2, str(out))
    assert json.loads(out.read_text()) == list(_step(4096, _rl_window(kl=True)))


def test_the_engines_logprobs_are_the_trainers_so_every_ratio_is_exactly_one():
    model = _model(torch.bfloat16)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    outs = Engine(model, max_num_seqs=4).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, n=2))
    rollouts = [Rollout(i // 2, o.token_ids, o.logprobs, "", o.finish_reason, "0") for i, o in enumerate(outs)]
    seqs, masks, loss = rollout_window(prompts, rollouts, [1.0, -1.0] * 3, RLConfig())
    cfg = TrainConfig(steps=1, seq_len=2, micro_batch_tokens=7, lr=1e-3, warmup=0, master_weights=True)
    Trainer(model, None, cfg).step(seqs, masks, loss)
    for i, m in enumerate(masks):
        assert torch.equal(loss.trainer_logprobs[i][m], loss.sampler_logprobs[i][m]), i
    # ...and they are lockstep.logprobs of the same tokens (what the loss saw before the update).
    assert torch.equal(loss.trainer_logprobs[0][masks[0]], loss.sampler_logprobs[0][masks[0]])


def test_policy_loss_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="ref_logprobs: kl_coef 0.1 needs"):
        PolicyLoss([torch.zeros(2)], [1.0], kl_coef=0.1)
    with pytest.raises(ValueError, match="mean: expected one of"):
        PolicyLoss([torch.zeros(2)], [1.0], mean="batch")
    seqs, masks, loss = _rl_window()
    loss.sampler_logprobs[0] = loss.sampler_logprobs[0][:-1]
    cfg = TrainConfig(steps=1, seq_len=2, micro_batch_tokens=4096, warmup=0)
    with pytest.raises(ValueError, match="sampler_logprobs: sequences 0..7 have"):
        Trainer(_model(), None, cfg).step(seqs, masks, loss)


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5], 4)
    assert adv[:4] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert adv[4:] == [0.0] * 4, "a group of equal rewards teaches nothing"


def test_task_answers_and_rewards():
    task = ArithmeticTask(max_operand=20, steps=2, multiply=True)
    for p in task.problems(200, random.Random(0)):
        # The answer, recomputed from the story's own numbers, in the story's order.
        numbers = [int(x) for x in parse_all(p.question)]
        assert numbers[:len(p.operands)] == p.operands and p.answer == evaluate(p.operands, p.operations)
        assert p.answer >= 0 and task.reward(p, f"The answer is {p.answer}.") == 1.0
        assert task.reward(p, f"{p.answer + 1}") == 0.0
    assert task.problems(5, random.Random(7)) == task.problems(5, random.Random(7))
    assert parse_answer("**1,204** apples") == 1204 and parse_answer("no idea") is None and parse_answer("-3") == -3
    rec = task.to_record(Problem("q", 4, [2, 2], ["+"]), "4 apples", 1.0)
    assert rec == {"question": "q", "answer": 4, "completion": "4 apples", "parsed": 4, "reward": 1.0}
    with pytest.raises(ValueError, match="count: expected a positive int"):
        task.problems(0, random.Random(0))
    with pytest.raises(ValueError, match="steps: expected 1 or 2"):
        ArithmeticTask(steps=3)


def test_every_problem_reads_back_to_its_answer():
    """check_problem reads a problem's story back without the code that wrote it and recomputes the
    answer; it names a wrong answer, a story that says another operation, and a number out of range."""
    task = ArithmeticTask(max_operand=20, steps=2, multiply=True)
    problems = task.problems(300, random.Random(1))
    assert all(check_problem(p, task) == [] for p in problems)
    assert {op for p in problems for op in p.operations} == {"+", "-", "*"}
    p = problems[0]
    assert any(e.startswith("answer") for e in check_problem(dataclasses.replace(p, answer=p.answer + 1), task))
    other = dataclasses.replace(p, operations=["+" if op != "+" else "-" for op in p.operations])
    assert any(e.startswith("the question says") for e in check_problem(other, task))
    assert any(e.startswith("operands") for e in check_problem(p, dataclasses.replace(task, max_operand=2)))


def parse_all(text: str) -> list[str]:
    import re

    return re.findall(r"\d+", text)
