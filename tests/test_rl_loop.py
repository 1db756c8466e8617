"""`lockstep rl` end to end over a real `lockstep serve` (a subprocess on 127.0.0.1): rollouts, the
Trainer's update, a weight push after every step, the exact sampler-trainer agreement, and a
resumed run that continues bitwise. The tiny model keeps it small; the real run is in README."""

import json
import os
import subprocess
import sys

import pytest

from lockstep import cli, dist, rl, train
from _rl_runs import COMPARED, TINY
from _rl_runs import weights as _weights


def test_rl_loop_is_exact_pushes_weights_and_resumes_bitwise(tmp_path, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert cli.main(["rl", *TINY, "--steps", "3", "--out", str(straight)]) == 0
    assert "max |dlogp| 0, max approx KL 0, max |mean ratio - 1| 0" in capsys.readouterr().out
    steps, events = train.read_log(str(straight))
    assert [r["step"] for r in steps] == [1, 2, 3] and events[0]["event"] == "start"
    for r in steps:
        assert r["max_abs_dlogp"] == 0 and r["approx_kl0"] == 0 and r["clipfrac0"] == 0 and r["mean_ratio"] == 1, r
    # Step N samples with the weights pushed after step N - 1 (SGLang's weight_version label).
    assert [(r["sampled_with_version"], r["weight_version"]) for r in steps] == [
        ("step-0", "step-1"), ("step-1", "step-2"), ("step-2", "step-3")]
    rows = [json.loads(line) for line in (straight / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 2 and {"question", "answer", "completion", "parsed", "reward"} <= set(rows[0])
    assert "reward" in (straight / "report.html").read_text()
    assert sorted(os.listdir(straight / "checkpoints")) == ["latest", "step-000002", "step-000003"], "keeps 2"

    assert cli.main(["rl", *TINY, "--steps", "2", "--out", str(split)]) == 0
    # How long a run goes and what it keeps on disk may change on resume; nothing else may.
    assert cli.main(["rl", *TINY, "--steps", "3", "--keep-checkpoints", "0", "--resume", "--out", str(split)]) == 0
    assert sorted(os.listdir(split / "checkpoints")) == ["latest", "step-000001", "step-000002", "step-000003"]
    capsys.readouterr()
    assert cli.main(["rl", *TINY, "--steps", "4", "--temperature", "0.5", "--resume", "--out", str(split)]) == 2
    assert "started with other settings (temperature); a resumed run keeps them (only --steps, --save-every" in \
        capsys.readouterr().err
    resumed, events = train.read_log(str(split))
    assert [e["event"] for e in events] == ["start", "resume"]
    keys = ("step", "loss", "grad_norm", "reward", "tokens")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in steps]
    assert (split / "rollouts.jsonl").read_text() == (straight / "rollouts.jsonl").read_text()
    assert _weights(split) == _weights(straight)


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(dist.free_port()), "-m", "lockstep",
                           "rl", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "shard-optimizer"])
def test_rl_under_torchrun_trains_the_bits_of_one_process(tmp_path, shard, rl_on_one_server):
    """Data parallel 2 (and another micro-batch size): rank 0 samples and broadcasts, each rank
    trains its share of the window (sequences of uneven lengths: the word problems' prompts differ);
    the same rollouts, losses and weights as one process, with AdamW's state replicated or sharded
    over the ranks (docs/adr/0037). Uneven completions at DP 2 are tested on the Trainer's step
    itself (test_rl.py)."""
    one, two = rl_on_one_server, tmp_path / "two"
    proc = _torchrun(*TINY, *COMPARED, "--micro-batch-tokens", "16", "--out", str(two),
                     *(["--shard-optimizer"] if shard else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps, events = train.read_log(str(two))
    assert events[0]["ranks"] == 2 and events[0]["layout"]["data_parallel"] == 2 and len(steps) == 2
    assert events[0]["layout"].get("shard_optimizer", False) is shard
    keys = ("step", "loss", "grad_norm", "reward", "tokens", "max_abs_dlogp", "approx_kl0", "mean_ratio")
    assert [[r[k] for k in keys] for r in steps] == one.rows(keys)
    assert all(r["max_abs_dlogp"] == 0 and r["mean_ratio"] == 1 for r in steps)
    assert (two / "rollouts.jsonl").read_text() == one.rollouts_text
    assert _weights(two) == _weights(one.out)
    assert "lockstep rl: 2 steps" in proc.stdout and proc.stdout.count("lockstep rl:") == 1, "rank 0 reports"


def test_rl_under_torchrun_stops_every_rank_when_rank_0_refuses(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    proc = _torchrun(*TINY, "--steps", "1", "--out", str(tmp_path / "taken"))
    assert proc.returncode != 0
    assert "is not empty" in proc.stderr and "out: rank 0 failed" in proc.stderr


def test_the_same_loop_on_eager_pytorch_shows_the_mismatch(tmp_path):
    """The server decodes one completion at a time (M = 1) and the trainer runs the step's sequences
    packed: stock fp32 PyTorch rounds the two differently on both CPUs this project has run on (Intel
    with MKL, AMD EPYC), while stock bf16 differs only on the Intel one. lockstep gives 0 in the same
    setting."""
    args = [*TINY, "--dtype", "fp32", "--max-num-seqs", "1", "--max-new-tokens", "16", "--steps", "1"]
    assert cli.main(["rl", *args, "--backend", "eager", "--out", str(tmp_path / "eager")]) == 0
    (rec,), _ = train.read_log(str(tmp_path / "eager"))
    assert rec["max_abs_dlogp"] > 0 and rec["approx_kl0"] > 0
    assert cli.main(["rl", *args, "--out", str(tmp_path / "lockstep")]) == 0
    (rec,), _ = train.read_log(str(tmp_path / "lockstep"))
    assert rec["max_abs_dlogp"] == 0 and rec["approx_kl0"] == 0 and rec["mean_ratio"] == 1


def test_on_the_real_model_in_bf16_stock_pytorch_is_off_policy_and_lockstep_is_not(tmp_path):
    """SmolLM2 in bf16, one step of 2 problems x 2 completions: the server decodes the completions
    together and the trainer runs them packed. Stock PyTorch's bf16 kernels round the two differently
    at SmolLM2's widths (measured: max |dlogp| 0.25 on an AMD EPYC); lockstep's are the same bits."""
    args = ["--dtype", "bf16", "--prompts-per-step", "2", "--group", "2", "--max-new-tokens", "8", "--steps", "1"]
    assert cli.main(["rl", *args, "--backend", "eager", "--out", str(tmp_path / "eager")]) == 0
    (rec,), _ = train.read_log(str(tmp_path / "eager"))
    assert rec["max_abs_dlogp"] > 0 and rec["approx_kl0"] > 0 and rec["mean_ratio"] != 1
    assert cli.main(["rl", *args, "--out", str(tmp_path / "lockstep")]) == 0
    (rec,), events = train.read_log(str(tmp_path / "lockstep"))
    assert events[0]["config"]["model"] == "smollm2"
    assert rec["max_abs_dlogp"] == 0 and rec["approx_kl0"] == 0 and rec["mean_ratio"] == 1


@pytest.mark.parametrize("args, message", [
    (["--group", "1"], "group: expected at least 2"),
    (["--steps", "0"], "steps: expected a positive int"),
    (["--resume"], "resume: no checkpoint in"),
    (["--keep-checkpoints", "-1"], "keep_checkpoints: expected an int >= 0, got -1"),
])
def test_rl_refuses_bad_settings(tmp_path, capsys, args, message):
    assert cli.main(["rl", "--model", "tiny", "--out", str(tmp_path / "x"), *args]) == 2
    assert message in capsys.readouterr().err


def test_summary_needs_steps(tmp_path):
    (tmp_path / "log.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no step"):
        rl.summary(str(tmp_path))
