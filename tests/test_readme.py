"""Every snippet of README.md runs, and says what it does.

- ```python blocks run as they are, each in a fresh namespace (their asserts are the claims).
- ```bash blocks: each command runs in one scratch folder per block that holds a `corpus.txt`; it
  must exit 0. `make` lines are the README's two set-up commands: CI runs `make test` itself, and
  `make verify` is `lockstep check` plus `lockstep verify`, whose parts the console blocks run.
- ```console blocks: each `$ command` runs; it must exit 0, or 1 where its comment says "exits 1";
  and the lines shown after it must appear in its output in order, numbers aside ("..." skips).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", README, flags=re.M | re.S)]
BIN = Path(sys.executable).parent


def _blocks(kind: str) -> list[str]:
    return [body for lang, body in BLOCKS if lang == kind]


def _command(line: str) -> list[str]:
    line = line.split("  #")[0].split(" # ")[0].strip()
    argv = shlex.split(line)
    if argv[0] == "lockstep":
        return [sys.executable, "-m", "lockstep", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *[str(ROOT / a) if a.endswith(".py") else a for a in argv[1:]]]
    if argv[0] == "torchrun":
        from lockstep.dist import free_port

        return [str(BIN / "torchrun"), "--master_port", str(free_port()), *argv[1:]]
    raise AssertionError(f"README runs {argv[0]!r}; the test knows lockstep, python and torchrun")


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900, env=env)


def _skeleton(line: str) -> str:
    """A line with its numbers, the machine's instruction sets (`isa=...`, those the native bits were
    compared on) and spacing abstracted: what must match between README and reality on any machine."""
    line = re.sub(r"\bisa=\S+( \(the compiler left out [^)]*\))?", "isa=*", line)
    line = re.sub(r"^native bits: the recorded ones on [^(]*\(", "native bits: the recorded ones on * (", line)
    return " ".join(re.sub(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", "#", line).split())


def test_the_readme_has_snippets_of_every_kind():
    assert _blocks("python") and _blocks("bash") and _blocks("console")


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_snippet_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _blocks("python")[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("index", range(len(_blocks("bash"))))
def test_bash_snippet_runs(index, tmp_path):
    (tmp_path / "corpus.txt").write_text("The quick brown fox jumps over the lazy dog. " * 400)
    lines = [x for x in _blocks("bash")[index].splitlines() if x.strip() and not x.startswith("#")]
    ran = 0
    for line in lines:
        if line.startswith("make "):
            continue
        proc = _run(_command(line), tmp_path)
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
        ran += 1
    assert ran or all(x.startswith("make ") for x in lines)


@pytest.mark.parametrize("index", range(len(_blocks("console"))))
def test_console_snippet_says_what_the_command_prints(index, tmp_path):
    body = _blocks("console")[index]
    runs, current = [], None
    for line in body.splitlines():
        if line.startswith("$ "):
            current = (line[2:], [])
            runs.append(current)
        elif current is not None:
            current[1].append(line)
    assert runs
    for command, shown in runs:
        proc = _run(_command(command), tmp_path)
        expected_status = 1 if "exits 1" in command else 0
        assert proc.returncode == expected_status, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        actual = [_skeleton(x) for x in proc.stdout.splitlines() if x.strip()]
        at = 0
        for want in (x for x in shown if x.strip()):
            if want.strip() == "...":
                continue
            wanted = _skeleton(want)
            while at < len(actual) and actual[at] != wanted:
                at += 1
            assert at < len(actual), f"{command}: README shows\n  {want}\nwhich the output lacks:\n{proc.stdout}"
            at += 1
