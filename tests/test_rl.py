"""`lockstep rl`: GRPO with rollouts through a real `lockstep serve` over HTTP and a weight update
after every step. With lockstep the sampler-trainer KL is exactly 0 at every step and the reward
rises; on the eager backend the same loop shows the mismatch."""


import pytest
import torch

from lockstep import cli, rl, train


def test_grpo_over_http_has_zero_mismatch_and_learns(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["rl", "--steps", "40", "--out", str(out)]) == 0
    steps, events = train.read_log(str(out))
    assert len(steps) == 40 and events[0]["event"] == "start"
    for r in steps:
        assert r["max_abs_dlogp"] == 0 and r["approx_kl"] == 0 and r["mean_ratio"] == 1, r
    assert [r["weights_version"] for r in steps] == list(range(1, 41)), "a weight update after every step"
    first = sum(r["reward"] for r in steps[:10]) / 10
    last = sum(r["reward"] for r in steps[-10:]) / 10
    assert last > first + 0.05, (first, last)
    page = (out / "report.html").read_text()
    assert "reward" in page and "sampler vs trainer" in page
    assert "max |dlogp| 0, max approx KL 0" in capsys.readouterr().out


def test_the_same_loop_on_eager_pytorch_shows_the_mismatch(tmp_path):
    assert cli.main(["rl", "--steps", "3", "--backend", "eager", "--out", str(tmp_path / "eager")]) == 0
    steps, _ = train.read_log(str(tmp_path / "eager"))
    assert all(r["max_abs_dlogp"] > 0 and r["approx_kl"] > 0 for r in steps)


def test_group_advantages_and_mismatch():
    adv = rl.group_advantages([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5], 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4, dtype=torch.float64)), "a group of equal rewards teaches nothing"
    m = rl.mismatch(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0]))
    assert m == {"max_abs_dlogp": 0.0, "approx_kl": 0.0, "mean_ratio": 1.0}
    assert rl.mismatch(torch.tensor([-1.0]), torch.tensor([-1.5]))["approx_kl"] > 0


def test_the_task_rewards():
    task = rl.AdditionTask()
    prompt = [rl.BOS, 7, rl.PLUS, 5, rl.EQUALS]
    assert task.answer(prompt) == 2
    assert task.reward(prompt, [2, rl.EOS]) == 1.0 and task.reward(prompt, [2, 3]) == 0.75
    assert task.reward(prompt, [3, rl.EOS]) == 0.5 and task.reward(prompt, [rl.PLUS]) == 0.0


@pytest.mark.parametrize("args, message", [
    (["--group", "1"], "group: expected at least 2"),
    (["--steps", "0"], "steps: expected a positive int"),
])
def test_rl_refuses_bad_settings(tmp_path, capsys, args, message):
    assert cli.main(["rl", "--out", str(tmp_path / "x"), *args]) == 2
    assert message in capsys.readouterr().err
