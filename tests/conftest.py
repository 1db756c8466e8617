import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter, which triton reads when it is
# first imported: set it before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# MKL's thread-dependent blocking on an Intel Xeon, on any machine (tests/_reblocking_blas.py).
if os.environ.get("LOCKSTEP_TEST_REBLOCKING_BLAS"):
    import _reblocking_blas

    _reblocking_blas.install(os.environ["LOCKSTEP_TEST_REBLOCKING_BLAS"])


def _reads_gpu_audit(item) -> bool:
    return "gpu_audit_output" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """GPU tests run wherever CUDA is present; elsewhere they are deselected and counted aloud. The
    tests that read the GPU audit run last (_GpuAudit)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_reads_gpu_audit)
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        items[:] = [item for item in items if "gpu" not in item.keywords]
        config.hook.pytest_deselected(items=gpu)
        config._lockstep_gpu_deselected = len(gpu)


@pytest.hookimpl(trylast=True)          # after -k, -m, --deselect and --lf have had their say
def pytest_collection_finish(session):
    """A serial run whose tests read the GPU audit starts it now, at the lowest priority (_GpuAudit)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    option = session.config.option
    if session.items and _reads_gpu_audit(session.items[-1]) and not (option.collectonly or option.setupplan):
        session.config._lockstep_gpu_audit = _GpuAudit(nice=19)


# Runs `lockstep gpu-audit` in its own process group at the given priority (argv: nice, output
# folder, the CLI's arguments). As soon as its parent, pytest, is gone, it removes the folder and
# takes the whole group down, the audit's compile workers included: a pytest killed from outside
# runs none of its own clean-up.
_AUDIT_BOOTSTRAP = """
import os, runpy, shutil, signal, sys, threading, time
parent, out = os.getppid(), sys.argv[2]
os.setpgrp()
os.nice(int(sys.argv[1]))
def watch():
    while os.getppid() == parent:
        time.sleep(1)
    shutil.rmtree(out, ignore_errors=True)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
sys.argv = ["lockstep"] + sys.argv[3:]
runpy.run_module("lockstep.cli", run_name="__main__")
"""


class _GpuAudit:
    """`lockstep gpu-audit` in a process of its own (the Triton backend must be imported with
    TRITON_INTERPRET=0, which this process cannot undo), its output in a temporary folder.

    On a fresh machine the audit compiles 538 binaries, about 12 minutes of one core, and the
    serial suite leaves about a third of 2 cores idle; so a serial run starts it once its tests are
    collected, at the lowest priority, and runs its tests last (ADR 0029)."""

    def __init__(self, nice: int = 0):
        self.out = tempfile.mkdtemp(prefix="lockstep-gpu-audit-")
        self.log = open(os.path.join(self.out, "audit.log"), "w+")
        self.stdout = open(os.path.join(self.out, "audit.txt"), "w+")
        self.process = None
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _AUDIT_BOOTSTRAP, str(nice), self.out,
                 "gpu-audit", "--out", self.out, "--json", os.path.join(self.out, "audit.json")],
                stdin=subprocess.DEVNULL, stdout=self.stdout, stderr=self.log, env=env)
        except BaseException:
            self.stop(keep=False)
            raise

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def result(self, timeout: float) -> tuple[pathlib.Path, list[dict], str]:
        """(output folder, the JSON records, stdout), once the audit has finished."""
        try:
            returncode = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            so_far = self._log_tail()
            self.stop(keep=True)
            raise AssertionError(f"lockstep gpu-audit did not finish in {timeout:.0f} s; its output so far, kept in "
                                 f"{self.out}:\n{so_far}") from None
        if returncode < 0:
            raise AssertionError(f"lockstep gpu-audit was killed by signal {-returncode} (out of memory?); output "
                                 f"in {self.out}:\n{self._log_tail()}")
        if returncode != 0:
            raise AssertionError(f"lockstep gpu-audit exited with {returncode}; output in {self.out}:\n{self._log_tail()}")
        self.stdout.seek(0)
        with open(os.path.join(self.out, "audit.json")) as f:
            return pathlib.Path(self.out), json.load(f), self.stdout.read()

    def stop(self, keep: bool) -> None:
        """Stops the audit and its workers if they still run; the folder goes unless `keep`."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)     # the workers too, should the audit have died first
            except ProcessLookupError:
                pass
            if self.process.poll() is None:     # killed before its bootstrap made its group
                self.process.kill()
            self.process.wait()
        if not self.log.closed:
            self.log.close()
            self.stdout.close()
        if not keep:
            shutil.rmtree(self.out, ignore_errors=True)


@pytest.fixture(scope="session")
def gpu_audit_output(request):
    """The GPU audit's output folder, its JSON records and its stdout (tests/test_gpu_audit.py)."""
    audit = getattr(request.config, "_lockstep_gpu_audit", None)
    if audit is None:                   # under xdist, or a run that was not going to ask for it
        audit = request.config._lockstep_gpu_audit = _GpuAudit()
    return audit.result(timeout=1500)


def pytest_sessionfinish(session, exitstatus):
    """The audit's output stays when a test failed, as pytest keeps a failed test's tmp_path."""
    audit = getattr(session.config, "_lockstep_gpu_audit", None)
    if audit is not None:
        audit.stop(keep=exitstatus != 0)
        if exitstatus != 0 and os.path.isdir(audit.out):
            session.config._lockstep_gpu_audit_kept = audit.out


def pytest_runtest_logreport(report):
    """With LOCKSTEP_FAILURE_LOG set, each failure's report is appended to that file as it happens
    (by the controller under xdist, once), so that a run stopped by a time limit, as on the GPU
    machine, still says why its failures failed."""
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
