"""The tiny `lockstep rl` run that the RL tests compare against: one server, one process, 3 prompts
a step for 2 steps. The many-server, Ray and torchrun tests must reproduce its rollouts, per-step
records and weights bit for bit, so conftest.py makes it once per session (`rl_on_one_server`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from lockstep import cli, rl, train
from lockstep.model.files import params_digest, read_tensors, safetensors_files

TINY = ["--model", "tiny", "--dtype", "bf16", "--prompts-per-step", "2", "--group", "2", "--max-new-tokens", "4",
        "--lr", "1e-3"]
# The compared run's length: 3 prompts of 2 completions a step, so that two servers, sent a request
# per prompt, take uneven shares.
COMPARED = ["--prompts-per-step", "3", "--steps", "2"]


def weights(run: Path) -> str:
    """The digest of the latest checkpoint's tensors in the run folder `run`."""
    ckpt = train.latest_checkpoint(str(run / "checkpoints"))
    tensors = {}
    for f in safetensors_files(ckpt):
        tensors.update(read_tensors(f))
    return params_digest(list(tensors.items()))


def run(out: Path, *args: str) -> tuple[list[dict], list[dict]]:
    """`lockstep rl` on the tiny model at the compared length in this process, into `out`; returns
    its log (steps, events)."""
    assert cli.main(["rl", *TINY, *COMPARED, "--out", str(out), *args]) == 0
    return train.read_log(str(out))


def record_rollouts(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every step's rollouts as the trainer receives them, appended to the returned list as
    (prompt index, token ids, logprobs) per rollout."""
    seen = []
    window = rl.rollout_window

    def recording(prompts, rollouts, advantages, cfg):
        seen.append([(r.prompt_index, r.token_ids, r.logprobs) for r in rollouts])
        return window(prompts, rollouts, advantages, cfg)

    monkeypatch.setattr(rl, "rollout_window", recording)
    return seen


@dataclass(frozen=True)
class Run:
    """A finished run: its folder, log and the rollouts the trainer received."""
    out: Path
    steps: list[dict]
    events: list[dict]
    sampled: list

    def rows(self, keys: tuple[str, ...]) -> list[list]:
        return [[r[k] for k in keys] for r in self.steps]

    @property
    def rollouts_text(self) -> str:
        return (self.out / "rollouts.jsonl").read_text()


def one_server(folder: Path) -> Run:
    with pytest.MonkeyPatch.context() as mp:
        sampled = record_rollouts(mp)
        steps, events = run(folder / "one")
    return Run(folder / "one", steps, events, [list(step) for step in sampled])
