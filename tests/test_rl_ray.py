"""`lockstep rl --ray`: the run placed on a Ray cluster started on this machine (127.0.0.1, CPUs only),
its rollout servers and its trainer's data-parallel ranks Ray actors, with the bits of the same run
without Ray: the same rollouts, per-step losses and final weights. Ray must start here: without it,
these tests fail rather than skip."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray._private.utils import get_ray_address_file

from lockstep import cli, dist, train
from _rl_runs import COMPARED, TINY, run, weights

# Runs argv[1:] with SIGINT at its default disposition.
DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.argv[1], sys.argv[1:])")
KEYS = ("step", "loss", "grad_norm", "reward", "tokens", "max_abs_dlogp", "approx_kl0", "mean_ratio",
        "sampled_with_version", "weight_version")


@pytest.fixture(autouse=True)
def no_ray_left():
    """Whatever a test does, no Ray cluster outlives it."""
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_on_a_local_ray_cluster_the_run_has_the_bits_of_the_run_without_ray(tmp_path, capsys, rl_on_one_server):
    """Two rollout servers (behind the router, on rank 0's node) and data parallel 2, each an actor."""
    plain = rl_on_one_server
    placed, events = run(tmp_path / "ray", "--ray", "--servers", "2", "--dp", "2", "--push-weights", "http")
    assert not ray.is_initialized(), "the cluster started for the run is shut down with it"
    assert events[0]["ranks"] == 2 and events[0]["layout"]["data_parallel"] == 2
    assert events[0]["push_weights"] == "http", "the ranks push as the command asked"
    assert [len(events[0]["placement"][kind]) for kind in ("servers", "ranks")] == [2, 2], events[0]["placement"]
    assert len(events[0]["servers"]) == 2 and events[0]["server"] not in events[0]["servers"]
    assert all(url.startswith("http://127.0.0.1:") for url in events[0]["servers"]), "this machine only"
    assert [[r[k] for k in KEYS] for r in placed] == plain.rows(KEYS)
    assert all(r["max_abs_dlogp"] == 0 and r["mean_ratio"] == 1 for r in placed)
    assert all(min(r["served"].values()) >= 1 for r in placed), "both servers serve every step"
    assert (tmp_path / "ray" / "rollouts.jsonl").read_text() == plain.rollouts_text
    assert weights(tmp_path / "ray") == weights(plain.out)
    assert "lockstep rl: 2 steps" in capsys.readouterr().out


def _ray_start(ray_cli: str, args: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    """`ray start ARGS --block` in a session of its own, with SIGINT at its default: a process
    started in the background by a non-interactive shell (nohup, a CI runner's job) ignores SIGINT,
    and so would every process it starts; `ray start --block` stops the processes it started on
    SIGINT."""
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-c", DEFAULT_SIGINT, ray_cli, "start", "--block", *args,
                                 "--disable-usage-stats"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop(node: subprocess.Popen) -> None:
    node.send_signal(signal.SIGINT)
    try:
        node.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=10)


def test_at_the_address_of_a_running_cluster(tmp_path, rl_on_one_server):
    """A cluster of two nodes started apart (`ray start --head` and `ray start --address`, both on
    this machine, one CPU each, with Ray's token authentication): the run connects to the head by
    address, places its server on one node and its rank on the other (one CPU each), records where
    it placed them, and leaves the cluster running; a run that fails on its rank says why in one
    line. The node address is this machine's own, where the server listens. The run is `lockstep
    rl` in a process of its own, as Ray reads RAY_AUTH_MODE when it is imported."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}      # the head's and the driver's, as Ray's docs say
    # `ray start` records its address for a later ray.init() on this machine; the test puts back what
    # was there, so that no one is sent to its head once it is gone.
    recorded = Path(get_ray_address_file(None))
    before = recorded.read_text() if recorded.exists() else None
    port = dist.free_port()
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    said, joined = tmp_path / "head.log", tmp_path / "worker.log"
    head = _ray_start(ray_cli, ["--head", "--port", str(port), "--num-cpus", "1", "--include-dashboard", "false"],
                      said, env)
    worker = None
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None and time.time() < deadline, f"the head did not come up: {said.read_text()[-3000:]}"
                time.sleep(0.5)
        # The second node: the run's second actor waits for its CPU until it has joined.
        worker = _ray_start(ray_cli, ["--address", f"127.0.0.1:{port}", "--num-cpus", "1"], joined, env)
        plain = rl_on_one_server
        # A rank's error is the command's one line, as under torchrun; the cluster stays up.
        taken = tmp_path / "taken"
        taken.mkdir()
        (taken / "file").write_text("x")
        refused = subprocess.run([sys.executable, "-m", "lockstep", "rl", *TINY, "--steps", "1", "--ray",
                                  f"127.0.0.1:{port}", "--out", str(taken)],
                                 capture_output=True, text=True, env=env, timeout=180)
        assert refused.returncode == 2 and f"lockstep rl: out: {taken} is not empty;" in refused.stderr
        proc = subprocess.run([sys.executable, "-m", "lockstep", "rl", *TINY, *COMPARED, "--ray", f"127.0.0.1:{port}",
                               "--out", str(tmp_path / "ray")],
                              capture_output=True, text=True, env=env, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:] + joined.read_text()[-2000:]
        placed, events = train.read_log(str(tmp_path / "ray"))
        assert head.poll() is None and worker.poll() is None, "the cluster outlives the run"
    finally:
        for node in (worker, head):
            if node is not None:
                _stop(node)
        if before is None:
            recorded.unlink(missing_ok=True)
        else:
            recorded.write_text(before)
    assert events[0]["ranks"] == 1
    where = events[0]["placement"]
    assert len(where["servers"]) == len(where["ranks"]) == 1
    assert where["servers"][0]["node_id"] != where["ranks"][0]["node_id"], "one CPU a node: one actor a node"
    assert [[r[k] for k in KEYS] for r in placed] == plain.rows(KEYS)
    assert (tmp_path / "ray" / "rollouts.jsonl").read_text() == plain.rollouts_text
    assert weights(tmp_path / "ray") == weights(plain.out)


@pytest.mark.parametrize("address, said", [
    ("127.0.0.1:1", "no Ray cluster answers there"),
    ("not an address", "expected 'auto' (the cluster this node belongs to), HOST:PORT"),
])
def test_a_bad_ray_address_is_one_line_naming_it(tmp_path, capsys, address, said):
    assert cli.main(["rl", *TINY, "--steps", "1", "--ray", address, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lockstep rl: --ray {address!r}: ") and said in err and err.count("\n") == 1, err
    assert "ray://HOST:PORT" in err and not ray.is_initialized()


def test_a_bad_push_is_refused_before_any_cluster_starts(tmp_path):
    from lockstep.rl import RLConfig, ray_run

    with pytest.raises(ValueError, match=r"^push_weights: expected one of \('auto', 'disk', 'http'\), got 'ftp'$"):
        ray_run.run(RLConfig(model="tiny"), str(tmp_path / "run"), push_weights="ftp")
    assert not ray.is_initialized()


def test_without_ray_the_flag_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)        # how Python marks a module it cannot import
    assert cli.main(["rl", *TINY, "--ray", "--out", str(tmp_path / "run")]) == 2
    assert "needs the ray extra (pip install 'lockstep[ray]'): no module named 'ray'" in capsys.readouterr().err
    # The flags of a Ray run, without --ray.
    assert cli.main(["rl", *TINY, "--dp", "2", "--out", str(tmp_path / "run")]) == 2
    assert "--dp, --ray-cpus and --ray-gpus place the run on a Ray cluster: add --ray [ADDRESS]" in capsys.readouterr().err
