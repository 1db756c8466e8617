import os
import shutil
import tempfile
import warnings

import pytest
import torch

import _audit_process
import _scheduling

# Without a GPU the Triton kernels run under Triton's interpreter, which triton reads when it is
# first imported: set it before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray starts its workers at nice 15. A Ray cluster of the suite does the work of a test that waits
# for it, so its actors run at that test's priority rather than below the side lane's (nice 10,
# tests/_scheduling.py).
os.environ.setdefault("RAY_worker_niceness", "0")

# MKL's thread-dependent blocking on an Intel Xeon, on any machine (tests/_reblocking_blas.py).
if os.environ.get("LOCKSTEP_TEST_REBLOCKING_BLAS"):
    import _reblocking_blas

    _reblocking_blas.install(os.environ["LOCKSTEP_TEST_REBLOCKING_BLAS"])


def _reads_gpu_audit(item) -> bool:
    return "gpu_audit_output" in getattr(item, "fixturenames", ())


_durations: _scheduling.DurationRecorder | None = None


def _xdist_controller(config) -> bool:
    return getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


def pytest_addoption(parser):
    parser.addoption("--lanes", action="store_true",
                     help="with -n 2: a main lane, and a side lane at a lower priority for the single-threaded "
                          "modules (tests/_scheduling.py)")


def _whole_suite(config) -> bool:
    """Whether this run is the whole suite's (`make test`): no paths, -k, -m, --lf, --deselect or
    --ignore narrow it, and it runs tests rather than printing help, markers or fixtures."""
    option = config.option
    narrowed = ("keyword", "markexpr", "lf", "deselect", "ignore", "ignore_glob", "collectonly", "setupplan",
                "help", "markers", "showfixtures", "show_fixtures_per_test", "version")
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS and not any(
        getattr(option, name, None) for name in narrowed)


def pytest_configure(config):
    """Under xdist the controller makes a folder that its workers share: the units of its schedule
    (_scheduling) and the GPU audit (_audit_process). The whole suite starts the audit now, before
    its tests are collected (the first collection builds the native kernels on one core).
    LOCKSTEP_RECORD_DURATIONS asks for the run's durations (_scheduling)."""
    global _durations
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if config.getoption("lanes") and not worker and getattr(config.option, "dist", "no") != "load":
        raise pytest.UsageError("--lanes: expected -n 2 (two pytest-xdist workers, one lane each)")
    _durations = None if worker else _scheduling.recorder()
    if _xdist_controller(config):
        config._lockstep_shared = os.environ["LOCKSTEP_XDIST_SHARED"] = tempfile.mkdtemp(prefix="lockstep-xdist-")
    if not worker and _whole_suite(config):
        _start_gpu_audit(config, getattr(config, "_lockstep_shared", None))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` alone (xdist's "load") runs the units of _scheduling, longest first; with --lanes, one
    lane per worker."""
    if config.option.dist == "load" and config.getoption("lanes"):
        return _scheduling.Lanes(config, log)
    if config.option.dist == "load":
        return _scheduling.LongestFirst(config, log, config._lockstep_shared)
    return None


def pytest_runtest_setup(item):
    """With --lanes, the worker that runs the side lane lowers its priority on its first test."""
    side = item.config.getoption("lanes") and _scheduling.lane(item.nodeid) == "side"
    if side and os.environ.get("PYTEST_XDIST_WORKER"):
        _scheduling.enter_side_lane()


def _shared_audit() -> str | None:
    """The GPU audit's folder under xdist (the controller's shared folder), else None."""
    shared = os.environ.get("LOCKSTEP_XDIST_SHARED") if os.environ.get("PYTEST_XDIST_WORKER") else None
    return os.path.join(shared, "audit") if shared else None


def pytest_collection_modifyitems(config, items):
    """GPU tests run wherever CUDA is present; elsewhere they are deselected and counted aloud. The
    tests that read the GPU audit run last (_audit_process); under xdist the longest work goes first
    and tests that share an expensive fixture share a worker (_scheduling)."""
    if torch.cuda.is_available():
        gpu = []
    else:
        gpu = [item for item in items if "gpu" in item.keywords]
        if gpu:
            items[:] = [item for item in items if "gpu" not in item.keywords]
            config.hook.pytest_deselected(items=gpu)
            config._lockstep_gpu_deselected = len(gpu)
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("LOCKSTEP_XDIST_SHARED"):
        _scheduling.write_units(os.environ["LOCKSTEP_XDIST_SHARED"], _scheduling.order(items, last=_reads_gpu_audit))
    else:
        items.sort(key=_reads_gpu_audit)


@pytest.hookimpl(trylast=True)          # after -k, -m, --deselect and --lf have had their say
def pytest_collection_finish(session):
    """A run whose tests read the GPU audit starts it now if the whole suite's run has not already,
    at the lowest priority (_audit_process): a serial run itself, under xdist the first worker to
    claim the audit's folder."""
    option, config = session.config.option, session.config
    started = getattr(config, "_lockstep_gpu_audit", None)
    if not any(_reads_gpu_audit(item) for item in session.items) or option.collectonly or option.setupplan:
        if started is not None:         # started with the whole suite, which this run turned out not to be
            started.stop(keep=False)
            config._lockstep_gpu_audit = None
        return
    if started is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        _start_gpu_audit(config, os.environ.get("LOCKSTEP_XDIST_SHARED") if worker else None,
                         watched=os.getppid() if worker else None)


def _start_gpu_audit(config, shared: str | None, watched: int | None = None) -> None:
    """Starts the GPU audit at the lowest priority: in a folder of its own, or in the folder `shared`
    with xdist's workers, there by the first process to claim it."""
    if shared is None:
        config._lockstep_gpu_audit = _audit_process.GpuAudit(nice=19)
        return
    folder = os.path.join(shared, "audit")
    try:
        os.mkdir(folder)
    except FileExistsError:
        return
    config._lockstep_gpu_audit = _audit_process.GpuAudit(nice=19, out=folder, watched=watched)


@pytest.fixture(scope="session")
def gpu_audit_output(request):
    """The GPU audit's output folder, its JSON records and its stdout (tests/test_gpu_audit.py)."""
    audit = getattr(request.config, "_lockstep_gpu_audit", None)
    shared = _shared_audit()
    if audit is None and shared and os.path.isdir(shared):
        return _audit_process.wait_for_audit(shared, timeout=1500)      # another worker started it
    if audit is None:                   # a run that was not going to ask for it
        audit = request.config._lockstep_gpu_audit = _audit_process.GpuAudit()
    return audit.result(timeout=1500)


@pytest.fixture(scope="session")
def rl_on_one_server(tmp_path_factory):
    """The tiny RL run on one server that the many-server, Ray and torchrun runs reproduce (_rl_runs)."""
    import _rl_runs

    return _rl_runs.one_server(tmp_path_factory.mktemp("rl-one-server"))


def pytest_sessionfinish(session, exitstatus):
    """The audit's output stays when a test failed, as pytest keeps a failed test's tmp_path. Under
    xdist the controller stops the audit, whether it or one of its workers started it."""
    failed, kept = exitstatus != 0, None
    audit = getattr(session.config, "_lockstep_gpu_audit", None)
    if audit is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        audit.stop(keep=failed)
        kept = audit.out
    shared = getattr(session.config, "_lockstep_shared", None)
    if shared is not None:
        audit_folder = os.path.join(shared, "audit")
        if os.path.isdir(audit_folder) and audit_folder != kept:       # a worker's
            _audit_process.stop_audit(audit_folder, keep=True)
            kept = audit_folder
        if not failed:
            shutil.rmtree(shared, ignore_errors=True)
    if failed and kept and os.path.isdir(kept):
        session.config._lockstep_gpu_audit_kept = kept
    if _durations is not None:
        _durations.write()


def pytest_runtest_logreport(report):
    """With LOCKSTEP_FAILURE_LOG set, each failure's report is appended to that file as it happens
    (by the controller under xdist, once), so that a run stopped by a time limit, as on the GPU
    machine, still says why its failures failed."""
    if _durations is not None:
        _durations.add(report)
    path = os.environ.get("LOCKSTEP_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        try:
            with open(path, "a", encoding="utf-8") as log:
                log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        except OSError as e:        # the log is a convenience: the run goes on without it
            warnings.warn(f"LOCKSTEP_FAILURE_LOG: cannot append to {path}: {e}")


def pytest_report_header(config):
    return f"lockstep: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"


def _stock_linear_follows_threads() -> bool:
    """Whether stock fp32 F.linear on a decode GEMM's shape (37 rows, 1024 by 3072) gives other bits on 1 and 2 threads: what
    an Intel Xeon's MKL does, and what lockstep's native kernels must not inherit."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 1024, generator=gen), torch.randn(3072, 1024, generator=gen)
    n = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(torch.nn.functional.linear(x, w))
    finally:
        torch.set_num_threads(n)
    return not torch.equal(*outs)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    kept = getattr(config, "_lockstep_gpu_audit_kept", None)
    if kept:
        terminalreporter.write_line(f"lockstep: the GPU audit's output is kept in {kept}")
    n = getattr(config, "_lockstep_gpu_deselected", 0)
    if n:
        terminalreporter.write_line(f"lockstep: {n} GPU tests deselected (no CUDA device on this machine)")
    # Which machine a run (CI's above all) landed on, since the BLAS's bits depend on it.
    follows = "differs" if _stock_linear_follows_threads() else "is the same"
    if os.environ.get("LOCKSTEP_TEST_REBLOCKING_BLAS"):
        follows += " (under the stand-in BLAS)"
    from lockstep.tools.bench import cpu_name

    terminalreporter.write_line(f"lockstep: ran on {cpu_name()}, {os.cpu_count()} CPUs, ATen "
                                f"{torch.backends.cpu.get_cpu_capability()}; stock fp32 linear on 1 vs 2 "
                                f"threads {follows}")


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
