"""lockstep.dist.launch: starting ranks (torchrun's environment, or `spawn` for tests and tools) with
a timeout, so that a rank that fails or hangs never leaves the others waiting."""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import checks

DEFAULT_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A rank of a `spawn`ed job raised; the message holds that rank's traceback."""


def _worker(rank: int, fn: Callable, world: int, port: int, backend: str, timeout_s: float, args: tuple,
            errors: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    except BaseException:
        # Recorded before the process group goes down: the other ranks' errors that follow
        # (connection reset, timeout) are consequences, and spawn reports the first one.
        with open(os.path.join(errors, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "time": time.time(), "traceback": traceback.format_exc()}, f)
        raise
    finally:
        if dist.is_initialized():          # fn may end the group itself (lockstep.train.run does)
            dist.destroy_process_group()


def spawn(fn: Callable, nprocs: int, *args, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run fn(rank, world_size, *args) on `nprocs` local processes with a process group.

    If a rank raises, the others are terminated and RankFailed is raised here with the traceback of
    the rank that failed first. Collectives time out after `timeout_s`, so no rank waits forever."""
    checks.int_at_least("nprocs", nprocs)
    with tempfile.TemporaryDirectory(prefix="lockstep-spawn-") as errors:
        try:
            mp.start_processes(_worker, args=(fn, nprocs, free_port(), backend, timeout_s, args, errors),
                               nprocs=nprocs, join=True, start_method="spawn")
        except Exception as e:
            reports = []
            for name in os.listdir(errors):
                with open(os.path.join(errors, name)) as f:
                    reports.append(json.load(f))
            if not reports:
                raise
            first = min(reports, key=lambda r: r["time"])
            raise RankFailed(f"rank {first['rank']} of {nprocs} failed; the job was stopped on every rank.\n"
                             f"{first['traceback']}") from e


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Initialise the process group from torchrun's environment; False when not distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True
