"""lockstep.rl.ray_run: `lockstep rl --ray [ADDRESS]`, the GRPO run placed on a Ray cluster, with the
bits of the same run without Ray.

What is placed where:
- each rollout server is a `ServerActor`: an actor that holds the server's resources (CPUs, or one
  GPU) and starts and owns the `lockstep serve` subprocess on its node, listening on the node's
  address; when the actor goes, its server goes with it;
- each data-parallel rank of the trainer is a `RankActor`: the ranks form a torch.distributed gloo
  group from the MASTER_ADDR/MASTER_PORT that rank 0's actor chose on its node, and each runs
  lockstep.rl.run, the code torchrun runs, with torchrun's environment variables. Rank 0 samples
  from the servers' URLs (behind SGLang's router on its node when there are several), pushes the
  weights to them and writes the run folder, as under torchrun.

The driver only places the actors, waits for them and takes rank 0's step records (the start event
records the node of each actor: `placement`); if a rank fails,
the others are stopped and its error is raised here. The run folder must be one path that every node
sees (a shared filesystem): the servers load the pushed weights from it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
from dataclasses import asdict
from types import ModuleType
from typing import TYPE_CHECKING

from .. import checks
from .rollout import PUSHES

if TYPE_CHECKING:
    from . import RLConfig

log = logging.getLogger("lockstep.rl")

ADDRESS_FORMS = ("'auto' (the cluster this node belongs to), HOST:PORT (the head's GCS address, which "
                 "`ray start --head` prints) or ray://HOST:PORT (Ray Client)")


class RayAddressError(ValueError):
    """`--ray ADDRESS` names no Ray cluster that answers."""


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise ImportError("--ray: Ray is not installed: pip install 'lockstep[ray]'") from None
    return ray


def _env() -> dict[str, str]:
    """What the actors' processes must inherit from this one: where lockstep is imported from and
    lockstep's own settings (Ray's workers start from the raylet's environment, not the driver's)."""
    return {k: v for k, v in os.environ.items() if k == "PYTHONPATH" or k.startswith("LOCKSTEP_")}


def _check_address(address: str) -> None:
    """A RayAddressError for an address of no expected form, or whose port nothing listens on (before
    ray.init, which retries an unreachable address for a minute or more)."""
    if address == "auto":
        return
    m = re.fullmatch(r"(?:ray://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", address)
    if m is None:
        raise RayAddressError(f"--ray {address!r}: expected {ADDRESS_FORMS}")
    host, port = m.group(1).strip("[]"), int(m.group(2))
    try:
        with socket.create_connection((host, port), timeout=5):
            pass
    except OSError as e:
        raise RayAddressError(f"--ray {address!r}: no Ray cluster answers there ({e}); expected {ADDRESS_FORMS} "
                              "of a running cluster") from None


def start(address: str | None, num_cpus: int, num_gpus: int) -> bool:
    """Connect to the Ray cluster at `address`, or start one on this machine (address None or "") with
    `num_cpus` CPUs and `num_gpus` GPUs, on 127.0.0.1 without the dashboard. Returns whether this call
    connected (and so must ray.shutdown); False when Ray was already initialized in this process."""
    ray = _ray()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")     # no report over the network
    runtime_env = {"env_vars": _env()}
    quiet = dict(include_dashboard=False, logging_level=logging.WARNING, runtime_env=runtime_env)
    if address:
        _check_address(address)
        try:
            ray.init(address=address, **quiet)
        except Exception as e:    # noqa: BLE001 -- Ray raises ConnectionError, RuntimeError or its own
            raise RayAddressError(f"--ray {address!r}: could not connect ({type(e).__name__}: {e}); expected "
                                  f"{ADDRESS_FORMS} of a running cluster (one with token authentication also "
                                  "needs RAY_AUTH_MODE=token and its token here)") from None
        return True
    # A new local cluster ("local": never one that `ray start` left recorded on this machine), with
    # bounded resources and object store, on this machine's loopback only.
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=256 * 1024 ** 2,
             _node_ip_address="127.0.0.1", **quiet)
    return True


def _node() -> dict[str, str]:
    """The Ray node this process runs on: its id and address."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address()}


class ServerActor:
    """One rollout server: `lockstep serve` started as a subprocess on this actor's node, holding a
    model of the run's architecture until the run pushes its weights (as with `--server URL`)."""

    def __init__(self, cfg: dict, host: str | None = None):
        import ray

        from ..model import model_from_source, with_byte_tokenizer
        from . import DTYPES, RLConfig
        from .rollout import RolloutClient

        c = RLConfig(**cfg)
        # The architecture of the trainer's model (lockstep.rl._run); its weights are pushed before any
        # rollout, so the server may start from any of them. Node-local, so no shared folder is needed.
        self.folder = tempfile.mkdtemp(prefix="lockstep-ray-server-")
        model = model_from_source(c.model, DTYPES[c.dtype], "llama", c.seed, vocab_size=320)
        with_byte_tokenizer(model).save(os.path.join(self.folder, "model"))
        del model
        host = host or ray.util.get_node_ip_address()
        try:
            self.client = RolloutClient(None, model=os.path.join(self.folder, "model"), dtype=c.dtype,
                                        backend=c.backend, host=host,
                                        max_num_seqs=c.max_num_seqs or c.prompts_per_step * c.group)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    def url(self) -> str:
        return self.client.url

    def node(self) -> dict[str, str]:
        return _node()

    def close(self) -> None:
        self.client.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class RankActor:
    """One data-parallel rank of the trainer: torchrun's environment, then lockstep.rl.run."""

    def node(self) -> dict[str, str]:
        return _node()

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it, for rank 0's MASTER_ADDR/MASTER_PORT."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def run(self, rank: int, world: int, master: tuple[str, int], cfg: dict, out: str, urls: list[str],
            resume: bool, progress: bool, accept_mismatch: bool, push_weights: str, placement: dict) -> list[dict]:
        import datetime

        import torch

        from ..dist import DEFAULT_TIMEOUT_S
        from . import RLConfig, run

        # Ray shows each actor only the GPUs it was given, so a rank's GPU is its device 0.
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        if world > 1:
            # gloo, even where the actor holds a GPU: lockstep rl's trainer keeps its tensors on the
            # CPU, which NCCL (what init_from_env would pick there) cannot reduce. rl.run finds the
            # group initialized and ends it.
            torch.distributed.init_process_group("gloo", rank=rank, world_size=world,
                                                 timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
        return run(RLConfig(**cfg), out, server_url=urls, resume=resume, progress=progress and rank == 0,
                   accept_mismatch=accept_mismatch, push_weights=push_weights, placement=placement)


def run(cfg: RLConfig, out: str, address: str | None = None, servers: int = 1, dp: int = 1, gpus: bool = False,
        cpus_per_actor: int = 1, resume: bool = False, progress: bool = True,
        accept_mismatch: bool = False, push_weights: str = "auto") -> list[dict]:
    """lockstep.rl.run on a Ray cluster (`address`; None or "": a cluster started here and shut down at
    the end): `servers` ServerActors and `dp` RankActors, each with `cpus_per_actor` CPUs and, with
    `gpus`, one GPU. The same bits as lockstep.rl.run without Ray with the same settings: the ranks
    run that very code, with `servers` servers at the URLs of the actors. Returns rank 0's records."""
    checks.int_at_least("servers", servers)
    checks.int_at_least("dp", dp)
    checks.int_at_least("cpus_per_actor", cpus_per_actor)
    checks.one_of("push_weights", push_weights, PUSHES)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--ray: places the trainer's ranks itself; run it as one process, not under torchrun")
    cfg.validate()
    ray = _ray()
    out = os.path.abspath(out)
    actors = servers + dp
    connected = start(address, actors * cpus_per_actor, actors if gpus else 0)
    resources = {"num_cpus": cpus_per_actor, "num_gpus": 1 if gpus else 0}
    placed: list = []
    try:
        _say_what_is_missing(ray, actors, cpus_per_actor, gpus)
        server_cls = ray.remote(ServerActor).options(**resources)
        # A local cluster listens on 127.0.0.1 only, and so do its servers.
        host = None if address else "127.0.0.1"
        pool = [server_cls.remote(asdict(cfg), host) for _ in range(servers)]
        placed += pool
        urls = ray.get([s.url.remote() for s in pool])
        rank_cls = ray.remote(RankActor).options(**resources)
        ranks = [rank_cls.remote() for _ in range(dp)]
        placed += ranks
        master = ray.get(ranks[0].rendezvous.remote())
        if not address:
            master = ("127.0.0.1", master[1])
        placement = {"servers": ray.get([s.node.remote() for s in pool]),
                     "ranks": ray.get([r.node.remote() for r in ranks])}
        for kind, nodes in placement.items():
            for i, where in enumerate(nodes):
                log.info("lockstep rl --ray: %s %d on node %s (%s)", kind[:-1], i, where["node_id"], where["address"])
        calls = [r.run.remote(i, dp, master, asdict(cfg), out, urls, resume, progress, accept_mismatch, push_weights,
                              placement)
                 for i, r in enumerate(ranks)]
        return _wait(ray, calls)[0]
    finally:
        _stop(ray, placed)
        if connected:
            ray.shutdown()


def _say_what_is_missing(ray: ModuleType, actors: int, cpus_per_actor: int, gpus: bool) -> None:
    """A warning when the cluster holds fewer CPUs or GPUs than the actors take: Ray then waits for
    them (an autoscaling cluster may add nodes) rather than fail, and the run would seem to hang."""
    have = ray.cluster_resources()
    need = {"CPU": actors * cpus_per_actor, "GPU": actors if gpus else 0}
    short = [f"{n} {kind}s (it has {have.get(kind, 0):g})" for kind, n in need.items() if have.get(kind, 0) < n]
    if short:
        log.warning("lockstep rl --ray: the run's %d actors take %s of the cluster; they wait until it has them",
                    actors, " and ".join(short))


def _wait(ray: ModuleType, calls: list) -> list:
    """Every call's result; the error of the first that fails is raised (rank 0's where it failed
    too), and the caller ends the other actors, which would otherwise wait on it until their
    collectives time out."""
    pending, results = list(calls), {}
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            results[done[0]] = _get(ray, done[0])
        except BaseException:
            if done[0] is not calls[0] and calls[0] in pending:
                # Rank 0 says why (the others only that rank 0 failed), when it fails in time; the
                # caller then ends every actor.
                ready, _ = ray.wait([calls[0]], timeout=10)
                if ready:
                    _get(ray, ready[0])
            raise
    return [results[c] for c in calls]


def _get(ray: ModuleType, ref) -> object:
    """ray.get, raising a rank's own error as it raised it (Ray's wrapper, which names the actor and
    its address, is its __cause__): the command line prints it in one line, as under torchrun."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, Exception):
            raise e.cause from e
        raise


def _stop(ray: ModuleType, actors: list) -> None:
    """Close the servers' subprocesses, then end every actor."""
    for a in actors:
        if hasattr(a, "close"):
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:       # noqa: BLE001 -- an actor that died took its server with it
                pass
        ray.kill(a)
