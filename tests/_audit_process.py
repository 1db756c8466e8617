"""`lockstep gpu-audit` run beside the suite, for the tests that read it (tests/conftest.py's
`gpu_audit_output`, tests/test_gpu_audit.py)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time


# Runs `lockstep gpu-audit` in its own process group at the given priority (argv: the pid it lives
# for, nice, output folder, the CLI's arguments), and writes its exit status to the file `exit`. As
# soon as that pid (pytest, or xdist's controller) is gone, it removes the folder and takes the
# whole group down, the audit's compile workers included: a pytest killed from outside runs none of
# its own clean-up.
_AUDIT_BOOTSTRAP = """
import os, runpy, shutil, signal, sys, threading, time, traceback
watched, out = int(sys.argv[1]), sys.argv[3]
os.setpgrp()
os.nice(int(sys.argv[2]))
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
def watch():
    while alive(watched):
        time.sleep(1)
    shutil.rmtree(out, ignore_errors=True)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
sys.argv = ["lockstep"] + sys.argv[4:]
code = 1
try:
    runpy.run_module("lockstep.cli", run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
except BaseException:
    traceback.print_exc()
with open(os.path.join(out, "exit.part"), "w") as f:
    f.write(str(code))
os.replace(os.path.join(out, "exit.part"), os.path.join(out, "exit"))
sys.exit(code)
"""


class GpuAudit:
    """`lockstep gpu-audit` in a process of its own (the Triton backend must be imported with
    TRITON_INTERPRET=0, which this process cannot undo), its output in a temporary folder.

    On a fresh machine the audit compiles about 670 binaries, 8 to 9 minutes of one core, so a run
    starts it early, at the lowest priority, and runs its tests last: the compiles take what the
    other tests leave idle (ADR 0029). The whole suite starts it before collecting its tests,
    under xdist from the controller; a narrower run once its tests are collected, under xdist from
    the first worker to claim the controller's folder. Either way it lives as long as the
    controller, every worker reads the result from that folder (`wait_for_audit`), and the
    controller stops it at the end."""

    def __init__(self, nice: int = 0, out: str | None = None, watched: int | None = None):
        self.out = out or tempfile.mkdtemp(prefix="lockstep-gpu-audit-")
        self.log = open(os.path.join(self.out, "audit.log"), "w+")
        self.stdout = open(os.path.join(self.out, "audit.txt"), "w+")
        self.process = None
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _AUDIT_BOOTSTRAP, str(watched or os.getpid()), str(nice), self.out,
                 "gpu-audit", "--out", self.out, "--json", os.path.join(self.out, "audit.json")],
                stdin=subprocess.DEVNULL, stdout=self.stdout, stderr=self.log, env=env)
            with open(os.path.join(self.out, "pid"), "w") as f:
                f.write(str(self.process.pid))
        except BaseException:
            self.stop(keep=False)
            raise

    def result(self, timeout: float) -> tuple[pathlib.Path, list[dict], str]:
        """(output folder, the JSON records, stdout), once the audit has finished (`wait_for_audit`)."""
        return wait_for_audit(self.out, timeout)

    def stop(self, keep: bool) -> None:
        """Stops the audit and its workers if they still run; the folder goes unless `keep`."""
        if self.process is not None:
            stop_audit(self.out, keep=True)
            if self.process.poll() is None:     # killed before its bootstrap made its group
                self.process.kill()
            self.process.wait()
        if not self.log.closed:
            self.log.close()
            self.stdout.close()
        if not keep:
            shutil.rmtree(self.out, ignore_errors=True)


def _log_tail(out: str) -> str:
    try:
        with open(os.path.join(out, "audit.log")) as f:
            return f.read()[-3000:]
    except OSError:
        return ""


def _audit_pid(out: str) -> int | None:
    try:
        with open(os.path.join(out, "pid")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _running(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:        # a child of this process that has ended but not been reaped still answers kill(0)
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def wait_for_audit(out: str, timeout: float) -> tuple[pathlib.Path, list[dict], str]:
    """(output folder, the JSON records, stdout) of the audit in `out`, once it has finished."""
    exit_file, deadline = os.path.join(out, "exit"), time.monotonic() + timeout
    while not os.path.exists(exit_file):
        if time.monotonic() > deadline:
            raise AssertionError(f"lockstep gpu-audit did not finish in {timeout:.0f} s; its output so far, in "
                                 f"{out}:\n{_log_tail(out)}")
        # Gone without an exit file (looked for again: it may have ended since the loop's test).
        if os.path.exists(os.path.join(out, "pid")) and not _running(_audit_pid(out)) and not os.path.exists(exit_file):
            raise AssertionError(f"lockstep gpu-audit was killed (out of memory?); output in {out}:\n{_log_tail(out)}")
        time.sleep(1)
    with open(exit_file) as f:
        returncode = int(f.read())
    if returncode != 0:
        raise AssertionError(f"lockstep gpu-audit exited with {returncode}; output in {out}:\n{_log_tail(out)}")
    with open(os.path.join(out, "audit.json")) as f, open(os.path.join(out, "audit.txt")) as g:
        return pathlib.Path(out), json.load(f), g.read()


def stop_audit(out: str, keep: bool) -> None:
    """Kills the audit's process group in `out` if it still runs; the folder goes unless `keep`."""
    pid = _audit_pid(out)
    if pid is not None:
        try:
            os.killpg(pid, signal.SIGKILL)      # the workers too, should the audit have died first
        except (ProcessLookupError, PermissionError):
            pass
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
