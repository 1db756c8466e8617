"""Commands that run side by side: each test that needs one waits for its own result, while the
next ones already run on the cores it leaves idle. For single-threaded work that several tests each
need one of (a compile of kernels.c, the Triton interpreter's sweeps under one OpenBLAS core), which
would otherwise hold one core at a time."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Mapping


class Alongside:
    """`commands` ({name: (argv, environment or None for this one's)}), started in their order on
    first use, as many at a time as the machine has cores; `result(name)` waits for that one and
    returns it (stdout and stderr as text). A fixture that makes one calls `stop()` at its end."""

    def __init__(self, commands: Mapping[str, tuple[list[str], Mapping[str, str] | None]], timeout: float = 600):
        self.commands, self.timeout = dict(commands), timeout
        self.width = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        self.queue, self.running, self.done = list(self.commands), {}, {}

    def _start(self, name: str) -> None:
        argv, env = self.commands[name]
        # Files, not pipes: a process that fills a pipe nobody reads yet would stop.
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.running[name] = subprocess.Popen(argv, env=None if env is None else dict(env), stdout=out, stderr=err,
                                              text=True), out, err
        self.queue.remove(name)

    def _fill(self) -> None:
        while self.queue and sum(p.poll() is None for p, _, _ in self.running.values()) < self.width:
            self._start(self.queue[0])

    def result(self, name: str) -> subprocess.CompletedProcess:
        if name not in self.done:
            if name in self.queue:
                self._start(name)
            proc, out, err = self.running[name]
            deadline = time.monotonic() + self.timeout
            while proc.poll() is None:  # polled, so that another's end starts the next at once
                self._fill()
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(proc.args, self.timeout)
                time.sleep(0.05)
            self._fill()
            out.seek(0)
            err.seek(0)
            self.done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
            out.close()
            err.close()
        return self.done[name]

    def stop(self) -> None:
        self.queue.clear()
        for proc, out, err in self.running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()
