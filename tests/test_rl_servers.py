"""`lockstep rl --servers N`: rollouts from several `lockstep serve` behind SGLang's real router
(sglang-router 0.3.2, subprocesses on 127.0.0.1), with the bits of one server: the same completions
(token ids, logprobs), losses and final weights with one server and with two, each of the two
serving part of every step; a server whose fingerprint differs from the trainer's is refused; a
server that dies mid-run (before a step, or while its requests run) leaves them to the others, with
the same bits; with none left the run stops in one line and `--resume` continues it bitwise. The router must run here: without it, these
tests fail rather than skip."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from lockstep import cli, rl, train
from lockstep.model import model_from_source, with_byte_tokenizer
from lockstep.rl import servers as rl_servers
from _rl_runs import COMPARED, TINY, record_rollouts, run, weights

KEYS = ("step", "loss", "grad_norm", "reward", "tokens", "max_abs_dlogp", "approx_kl0", "mean_ratio")


@pytest.fixture
def sampled(monkeypatch) -> list:
    """Every step's rollouts as the trainer received them: (prompt index, token ids, logprobs)."""
    return record_rollouts(monkeypatch)


def test_two_servers_behind_the_router_give_the_bits_of_one(tmp_path, sampled, rl_on_one_server):
    one = rl_on_one_server
    two, events = run(tmp_path / "two", "--servers", "2")
    assert len(events[0]["servers"]) == 2 and events[0]["server"] not in events[0]["servers"]   # the router's URL
    assert sampled == one.sampled and len(sampled) == 2 and all(len(step) == 3 * 2 for step in sampled)
    assert any(lp for step in sampled for _, _, lp in step)
    assert [[r[k] for k in KEYS] for r in two] == one.rows(KEYS)
    assert all(r["max_abs_dlogp"] == 0 and r["mean_ratio"] == 1 for r in two)
    assert (tmp_path / "two" / "rollouts.jsonl").read_text() == one.rollouts_text
    assert weights(tmp_path / "two") == weights(one.out)
    # One request per prompt, round robin: both servers serve part of every step.
    for r in two:
        assert sorted(r["served"]) == sorted(events[0]["servers"]) and sum(r["served"].values()) == 3, r["served"]
        assert min(r["served"].values()) >= 1, r["served"]
    assert [(r["sampled_with_version"], r["weight_version"]) for r in two] == [("step-0", "step-1"),
                                                                             ("step-1", "step-2")]
    # Servers already running (--server given twice), behind a router the run starts: the run pushes
    # its initial weights first, so they may start from any model of the architecture. Here the
    # weights travel in the requests, as they must to servers on other hosts (--push-weights http).
    sampled.clear()
    pushed = []
    update = rl_servers.RolloutClient.update_weights

    def spying(client, *args):
        pushed.append(client.over_http)
        return update(client, *args)
    folder = str(tmp_path / "other-weights")
    with_byte_tokenizer(model_from_source("tiny", torch.bfloat16, "llama", 1, vocab_size=320)).save(folder)
    running = [rl_servers.RolloutClient(None, model=folder, dtype="bf16", max_num_seqs=4) for _ in range(2)]
    try:
        urls = [arg for c in running for arg in ("--server", c.url)]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rl_servers.RolloutClient, "update_weights", spying)
            given, events = run(tmp_path / "given", *urls, "--push-weights", "http")
    finally:
        for c in running:
            c.close()
    assert pushed and all(pushed), pushed           # every push, to each server, in the request
    assert events[0]["servers"] == [c.url for c in running] and sampled == one.sampled
    assert [[r[k] for k in KEYS] for r in given] == one.rows(KEYS)
    assert weights(tmp_path / "given") == weights(one.out)
    assert all(min(r["served"].values()) >= 1 for r in given)


def _other_torch(monkeypatch) -> str:
    """The trainer's fingerprint with another torch version than the servers', which report their own."""
    other = "0.0.0+elsewhere"
    ours = rl.fingerprint
    monkeypatch.setattr(rl, "fingerprint", lambda *a: {**ours(*a), "torch": other})
    return other


def test_a_server_that_computes_differently_is_refused_naming_the_field(tmp_path, monkeypatch, capsys, caplog):
    other = _other_torch(monkeypatch)
    assert cli.main(["rl", *TINY, "--steps", "1", "--servers", "2", "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "computes differently from the trainer (torch: the trainer has " \
           f"'{other}', the server '{torch.__version__}')" in err, err
    assert "Pass --accept-mismatch to sample from it anyway" in err
    with caplog.at_level(logging.WARNING, logger="lockstep.rl"):
        assert cli.main(["rl", *TINY, "--steps", "1", "--accept-mismatch", "--out", str(tmp_path / "accepted")]) == 0
    assert f"torch: the trainer has '{other}', the server '{torch.__version__}'" in caplog.text
    assert "(--accept-mismatch)" in caplog.text
    # The run's log keeps both sides of what was accepted.
    _, events = train.read_log(str(tmp_path / "accepted"))
    said = events[0]["fingerprints"]
    assert [f["torch"] for f in said["ranks"]] == [other] and [f["torch"] for f in said["servers"]] == [torch.__version__]
    assert said["ranks"][0]["backend"] == said["servers"][0]["backend"] is not None


def _ranks_worker(rank, world, out, accept):
    from lockstep import machine

    ours = {**machine.fingerprint(), "isa": "avx2" if rank == 1 else "avx512"}
    try:
        found = machine.check_ranks(lambda: ours, accept_mismatch=accept)
        said = f"ok {[f['isa'] for f in found]}"
    except machine.FingerprintMismatch as e:
        said = f"refused {e}"
    with open(f"{out}.{rank}", "w") as f:
        f.write(said)


def _failing_rank_worker(rank, world, out):
    from lockstep import machine

    def ours():
        if rank == 1:
            raise OSError("no kernels here")
        return machine.fingerprint()

    try:
        machine.check_ranks(ours)
        said = "ok"
    except RuntimeError as e:
        said = f"refused {e}"
    with open(f"{out}.{rank}", "w") as f:
        f.write(said)


def test_a_rank_whose_fingerprint_fails_stops_every_rank(tmp_path):
    from lockstep import dist as ldist

    ldist.spawn(_failing_rank_worker, 2, str(tmp_path / "said"))
    said = {(tmp_path / f"said.{rank}").read_text() for rank in (0, 1)}
    assert said == {"refused trainer rank 1 could not tell what it computes with: OSError: no kernels here"}


@pytest.mark.parametrize("accept", [False, True])
def test_a_trainer_rank_that_computes_differently_is_refused_on_every_rank(tmp_path, accept):
    """Under torchrun or Ray every rank's fingerprint is compared with rank 0's: a rank that differs
    stops every rank at once (none waits in a collective), unless --accept-mismatch."""
    from lockstep import dist as ldist

    ldist.spawn(_ranks_worker, 2, str(tmp_path / "said"), accept)
    said = [(tmp_path / f"said.{rank}").read_text() for rank in (0, 1)]
    if accept:
        assert said == ["ok ['avx512', 'avx2']"] * 2
    else:
        assert said[0] == said[1] == ("refused trainer rank 1 computes differently from rank 0 (isa: rank 0 has "
                                      "'avx512', rank 1 'avx2'); the ranks' gradients would not add up to one "
                                      "process's bits. Pass --accept-mismatch to train anyway")


def test_a_push_goes_in_the_request_to_a_server_on_another_host():
    client = rl_servers.RolloutClient.__new__(rl_servers.RolloutClient)
    for url, push, over_http in (("http://127.0.0.1:8000", "auto", False), ("http://10.0.0.5:8000", "auto", True),
                                 ("http://localhost:8000", "http", True), ("http://10.0.0.5:8000", "disk", False)):
        client.url, client.push = url, push
        assert client.over_http is over_http, (url, push)
    with pytest.raises(ValueError, match=r"^push: expected one of \('auto', 'disk', 'http'\), got 'ftp'$"):
        rl_servers.RolloutClient("http://127.0.0.1:1", push="ftp")


def test_flags_that_contradict_each_other_are_refused(tmp_path, capsys):
    assert cli.main(["rl", *TINY, "--servers", "2", "--server", "http://127.0.0.1:1", "--out", str(tmp_path)]) == 2
    assert "give one or the other" in capsys.readouterr().err
    assert cli.main(["rl", *TINY, "--servers", "0", "--out", str(tmp_path)]) == 2
    assert "--servers: expected a positive int, got 0" in capsys.readouterr().err


def _kill_before_step(monkeypatch, step: int, which) -> None:
    """Kill servers (which(pool) -> the RolloutClients to kill) just before the rollouts of `step`."""
    generate = rl_servers.ServerPool.generate
    calls = []

    def killing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            for s in which(self):
                s.process.kill()
                s.process.wait(timeout=10)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(rl_servers.ServerPool, "generate", killing)


def test_a_server_that_dies_mid_run_leaves_its_requests_to_the_others(tmp_path, monkeypatch, sampled,
                                                                      rl_on_one_server):
    one = rl_on_one_server
    _kill_before_step(monkeypatch, 2, lambda pool: pool.servers[:1])
    two, events = run(tmp_path / "two", "--servers", "2")
    assert sampled == one.sampled
    assert [[r[k] for k in KEYS] for r in two] == one.rows(KEYS)
    assert weights(tmp_path / "two") == weights(one.out)
    dead = events[0]["servers"][0]
    assert two[1]["served"][dead] == 0 and sum(two[1]["served"].values()) == 3, two[1]["served"]


def test_with_no_server_left_the_run_stops_with_a_clear_error_and_resumes_bitwise(tmp_path, monkeypatch, capsys,
                                                                                  rl_on_one_server):
    one = rl_on_one_server
    _kill_before_step(monkeypatch, 2, lambda pool: pool.servers)
    out = tmp_path / "none"
    assert cli.main(["rl", *TINY, *COMPARED, "--servers", "2", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "lockstep rl: rollout: no rollout server is left (" in err and "do not answer /health" in err, err
    assert f"the last checkpoint is kept in {out}" in err
    assert [r["step"] for r in train.read_log(str(out))[0]] == [1]
    # The run goes on from its checkpoint, here on one server, as if nothing had stopped it.
    monkeypatch.undo()
    resumed, events = run(out, "--resume")
    assert [e["event"] for e in events] == ["start", "resume"]
    assert [[r[k] for k in KEYS] for r in resumed] == one.rows(KEYS)
    assert (out / "rollouts.jsonl").read_text() == one.rollouts_text
    assert weights(out) == weights(one.out)


def test_a_server_killed_while_its_requests_run_leaves_them_to_the_other():
    """The pool alone (two servers of the tiny model, the router): one server killed a third of the
    way through a batch of long completions; the router sends its requests to the other, and the
    answers are the bits of the same batch with both alive."""
    pool = rl_servers.ServerPool(None, 2, rl.fingerprint("auto"), model="tiny", dtype="bf16", max_num_seqs=8)
    try:
        prompts = [[1, 2, 3], [4, 5, 6], [7, 8], [9, 10]]
        pool.generate(prompts, 2, 120, 1.0, 5)    # the servers capture their decode steps: later batches replay
        started = time.time()
        want = pool.generate(prompts, 2, 120, 1.0, 5)
        took = time.time() - started
        victim = pool.servers[0].process
        killer = threading.Timer(took / 3, victim.kill)
        killer.start()
        got = pool.generate(prompts, 2, 120, 1.0, 5)
        killer.join()
        victim.wait(timeout=10)
        assert [(r.prompt_index, r.token_ids, r.logprobs) for r in got] == \
            [(r.prompt_index, r.token_ids, r.logprobs) for r in want]
        assert pool.alive() == pool.servers[1:]
    finally:
        pool.close()
