"""How the suite's tests are spread over pytest-xdist's workers (`make test` on 2 cores or more, and
`pytest -n N` anywhere; ADR 0029).

- Tests that share an expensive module fixture (SHARED_FIXTURES) form one unit and run on one
  worker, so that the fixture is made once. Each worker writes the units it collected to the
  controller's folder (`write_units`), and the controller's scheduler (`LongestFirst`) reads them.
  xdist's own `loadgroup` cannot do this under pytest 9: the group it appends to a test's id no
  longer reaches the scheduler.
- The longest units start first, so that no long test starts last while the other workers idle:
  a unit weighs what its tests took in a serial run on the 2-core machine CI uses (durations.json;
  a test not listed weighs DEFAULT_SECONDS). The tests that read the GPU audit go last.
- `LOCKSTEP_RECORD_DURATIONS=tests/durations.json` writes a run's durations there at its end (a
  serial run's, `pytest -p no:xdist`, as the weights are).

On 2 or 3 cores `make test` runs two lanes instead (`-n 2 --lanes`, `Lanes`): a main lane, and a side
lane at a lower priority (SIDE_NICE) that takes SIDE_LANE's modules, whose work is single-threaded and
bounded by no clock. The main lane's tests fill the machine only part of the time (their own
threads and subprocesses, one core at times); the side lane and the GPU audit, at the lowest priority,
take what they leave, instead of running one after the other at the end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest
from xdist.scheduler import LoadScopeScheduling

DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_SECONDS = 0.3
# Module fixtures whose making costs more than a test: compiles of kernels.c, a wheel, a real model,
# the OpenBLAS cores' sweeps.
SHARED_FIXTURES = ("reduced_build", "cross_compiles", "openblas_probes", "wheel_install", "hf_reference", "smol",
                   "references")
UNITS_FILE = "units.json"
# The side lane: modules that compute on one thread in the test's own process (the Triton
# interpreter's sweeps, the real model against transformers' in one process), with no subprocess or
# timeout that a starved lane could trip, and no expensive fixture shared with another module.
SIDE_LANE = frozenset({"tests/test_triton.py", "tests/test_gguf.py", "tests/test_model_runner.py",
                       "tests/test_mode_triton.py", "tests/test_engine.py", "tests/test_native_attention.py",
                       "tests/test_vocab_logprobs.py"})
# Below the main lane's tests (nice 0) and above the GPU audit (nice 19): the audit's compiles spread
# over every core once the tests are done, the side lane's tests run on one.
SIDE_NICE = 10


def order(items: list[pytest.Item], last: Callable[[pytest.Item], bool]) -> dict[str, str]:
    """Sorts `items` in place, heaviest unit first and the items for which `last` holds at the end;
    returns {test id: unit} for the tests that share a fixture."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        names = getattr(item, "fixturenames", ())
        fixture = next((name for name in SHARED_FIXTURES if name in names), None)
        key = item.nodeid if fixture is None else f"{item.nodeid.split('::')[0]}::{fixture}"
        units.setdefault(key, []).append(item)
    weight = {key: sum(known.get(i.nodeid, DEFAULT_SECONDS) for i in members) for key, members in units.items()}
    ordered = sorted(units, key=lambda key: (any(last(i) for i in units[key]), -weight[key]))
    items[:] = [i for key in ordered for i in units[key]]
    return {i.nodeid: key for key, members in units.items() if len(members) > 1 for i in members}


def write_units(folder: str, units: dict[str, str]) -> None:
    """Leaves `units` for the controller (every worker collects the same tests and writes the same)."""
    part = os.path.join(folder, f"{UNITS_FILE}.{os.getpid()}")
    with open(part, "w") as f:
        json.dump(units, f)
    os.replace(part, os.path.join(folder, UNITS_FILE))


class LongestFirst(LoadScopeScheduling):
    """xdist's scope scheduling with the workers' units as scopes, in the workers' order: each worker
    holds at most two units ahead and takes the next as it finishes one."""

    def __init__(self, config: pytest.Config, log, folder: str):
        super().__init__(config, log)
        self.folder, self.units = folder, None
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        if self.units is None:          # read once, when every worker has collected
            try:
                with open(os.path.join(self.folder, UNITS_FILE)) as f:
                    self.units = json.load(f)
            except OSError:
                self.units = {}
        return self.units.get(nodeid, nodeid)


def lane(nodeid: str) -> str:
    """"side" for a test of SIDE_LANE's modules, else "main"."""
    return "side" if nodeid.split("::")[0] in SIDE_LANE else "main"


class Lanes(LoadScopeScheduling):
    """Two workers, one lane each: xdist's scope scheduling with the lanes as scopes, each lane in the
    order its worker collected it (`order`: the heaviest unit first, the audit's readers last). The
    worker that draws the side lane lowers its own priority on its first test (`enter_side_lane`)."""

    def __init__(self, config: pytest.Config, log):
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return lane(nodeid)


def enter_side_lane() -> None:
    """Lowers this process's priority to SIDE_NICE: every thread's, since Linux keeps a nice value per
    thread (torch's pool may already run); the threads and processes started later inherit it."""
    tasks = "/proc/self/task"
    threads = [int(t) for t in os.listdir(tasks)] if os.path.isdir(tasks) else [0]
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < SIDE_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, SIDE_NICE)
        except ProcessLookupError:          # a thread that ended since the listing
            pass


class DurationRecorder:
    """Adds up each test's setup, call and teardown seconds and writes them, rounded, to `path`."""

    def __init__(self, path: str):
        self.path, self.seconds = Path(path), {}

    def add(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def write(self) -> None:
        kept = {k: round(v, 1) for k, v in sorted(self.seconds.items()) if v >= 0.5}
        self.path.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n")


def recorder() -> DurationRecorder | None:
    path = os.environ.get("LOCKSTEP_RECORD_DURATIONS")
    return DurationRecorder(path) if path else None
