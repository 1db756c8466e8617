"""The installed package, as a user gets it from a wheel: every file it reads at run time is inside,
the native backend builds from it, the core jobs need no extra, and a command that needs one says
which."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lockstep.backends.native import build

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "lockstep"


# What the extras bring (pyproject.toml), and what the test extra adds; none is a core dependency.
# (pydantic and starlette come with fastapi.)
OPTIONAL = ("transformers", "fastapi", "uvicorn", "httpx", "triton", "trl", "openai", "gguf", "ziglang", "pydantic",
            "starlette", "sglang_router", "ray")


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel `pip wheel .` builds, the folder it is installed into alone)."""
    root = tmp_path_factory.mktemp("wheel")
    # Built from a copy: a build writes build/ and *.egg-info beside its source.
    tree = root / "tree"
    shutil.copytree(PACKAGE.parent, tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(root / "dist"), str(tree)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (root / "dist").glob("lockstep-*.whl")
    site = root / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return wheel, site


def run_installed(site: Path, code: str, tmp_path: Path, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that imports lockstep from `site`, with the `blocked` modules
    unimportable (a None in sys.modules is how Python marks one). The suite's cache folder serves
    the native kernels (the installed sources are the clone's, so their key is the same: the wheel
    test checks it), or, where the suite has not built them yet, they are compiled into it."""
    prelude = "".join(f"import sys; sys.modules[{name!r}] = None\n" for name in blocked)
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)


def test_a_wheel_holds_every_file_of_the_package_and_runs_the_native_backend(wheel_install, tmp_path):
    """`pip wheel .` packs every file under src/lockstep that is not Python (the contract, the
    native kernels' source, their recorded bits); installed from that wheel alone, lockstep runs the
    native backend, not the portable fallback, and its kernels give the recorded bits. Its kernel
    sources name the clone's cached library (the key reads every source file's name and bytes, the
    flags and the compiler), so the suite's build of the clone serves it rather than a second
    compile of the same bytes."""
    wheel, site = wheel_install
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    assert {"lockstep/contract.toml", "lockstep/backends/native/kernels.c", "lockstep/backends/native/kernels.h",
            "lockstep/backends/native/recorded_bits.json"} <= data
    assert {p.relative_to(PACKAGE.parent).as_posix() for p in build.SOURCES} <= data
    assert data <= names, sorted(data - names)

    proc = run_installed(site, "import torch, lockstep\nfrom lockstep import ops, registry\n"
                               "print(lockstep.__file__)\nprint(registry.cpu_backend())\n"
                               "print(ops.linear(torch.ones(2, 3), torch.ones(4, 3)).sum().item())\n"
                               "from lockstep.backends.native import bits\n"
                               "print(bits.describe(bits.compare(bits.recorded()['kernels'])) or 'same')\n"
                               "from lockstep.tools import backend_bits\n"
                               "print(', '.join(backend_bits.compare(bits.recorded())['differ']) or 'same')\n"
                               "from lockstep.backends.native import build\n"
                               "print(build.cached_library(build.compiler()))\n",
                         tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, backend, total, differ, backend_differ, cached = proc.stdout.split("\n")[:6]
    assert cached == str(build.cached_library(build.compiler())), "the installed kernel sources are not the clone's"
    assert differ == "same", f"the installed kernels' bits are not the recorded ones in {differ}"
    assert backend_differ == "same", f"the installed native backend's bits are not the recorded ones in {backend_differ}"
    assert Path(where).is_relative_to(site), where
    assert backend == "native", proc.stderr
    assert float(total) == 24.0
    assert "native CPU backend is not in use" not in proc.stderr


def test_the_package_data_holds_every_file_the_kernels_compile_and_each_names_the_build(tmp_path):
    """kernels.c is one translation unit with the files it includes, which are the build's sources
    (build.SOURCES): pyproject.toml's package data matches each, so a wheel carries it, and a change
    to any one of them names another cached library, so a build of the old sources is not loaded."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["lockstep"]
    folder, included, todo = build.SOURCE.parent, {build.SOURCE.name}, [build.SOURCE.name]
    while todo:
        for name in re.findall(r'^#include "([^"]+)"', (folder / todo.pop()).read_text(), flags=re.M):
            if name not in included:
                included.add(name)
                todo.append(name)
    assert sorted(included) == [p.name for p in build.SOURCES]
    for path in build.SOURCES:
        assert any(fnmatch.fnmatch(path.relative_to(PACKAGE).as_posix(), p) for p in patterns), path.name

    copies = [Path(shutil.copy(p, tmp_path)) for p in build.SOURCES]
    cc = build.compiler()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "SOURCES", tuple(copies))
        first = build.cached_library(cc)
        keys = {first}
        for copy in copies:
            text = copy.read_bytes()
            copy.write_bytes(text + b"\n")
            keys.add(build.cached_library(cc))
            copy.write_bytes(text)
        assert build.cached_library(cc) == first
    assert len(keys) == len(copies) + 1


def test_the_core_jobs_run_without_any_extra(wheel_install, tmp_path):
    """Installed with its core dependencies alone (every extra's module unimportable), lockstep
    checks an op, loads the real model with its tokenizer and chat template, runs the
    train-inference gate on it (`lockstep verify`, cut to one setting; it leaves out the batch
    experiment and says why), compares two layouts, checks the tiny model, trains it and reports
    the run, and imports none of its integrations on the way."""
    _, site = wheel_install
    code = ("from lockstep import cli, verify\n"
            "verify.SETTINGS = verify.SETTINGS[:1]\n"
            "open('corpus.txt', 'w').write('The quick brown fox jumps over the lazy dog. ' * 50)\n"
            "for argv in (['check', 'linear', '--dtype', 'fp32', '--no-large'],\n"
            "             ['verify', '--max-new-tokens', '2', '--no-eager'],\n"
            "             ['parity', '--a', 'layout=alone', '--b', 'layout=batch8'],\n"
            "             ['check-model', 'tiny'],\n"
            "             ['train', '--model', 'tiny', '--data', 'corpus.txt', '--steps', '2', '--out', 'run'],\n"
            "             ['report', 'run']):\n"
            "    assert cli.main(argv) == 0, argv\n"
            "print('integrations:', sorted(m for m in sys.modules if m.startswith(('lockstep.server', "
            "'lockstep.integrations'))))\n")
    proc = run_installed(site, code, tmp_path, blocked=OPTIONAL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "lockstep: 0 / 0 / 0 and identical tokens in every setting" in proc.stdout
    # The gate needs only lockstep; the batch experiment runs stock transformers beside it, and says
    # in one line why it is not there.
    assert ("(no batch experiment: it runs stock transformers beside lockstep, and transformers is not installed: "
            "pip install 'lockstep[hf]')") in proc.stdout.splitlines()
    assert "The batch experiment" not in proc.stdout
    assert "lockstep train: 2 steps" in proc.stdout and (tmp_path / "run" / "report.html").exists()
    assert proc.stdout.splitlines()[-1] == "integrations: []"


@pytest.mark.parametrize("argv, missing, extra", [
    (["rl", "--model", "tiny", "--steps", "1", "--out", "runs/rl"], "httpx", "rl"),
    (["rl", "--model", "tiny", "--steps", "1", "--out", "runs/rl"], "uvicorn", "rl"),
    (["rl", "--model", "tiny", "--steps", "1", "--ray", "--out", "runs/rl"], "ray", "ray"),
    (["serve", "tiny"], "fastapi", "serve"),
    (["parity", "--trajectory", "native", "plain", "--steps", "1", "--json", "out/p.json"], "transformers", "hf"),
    (["gpu-audit"], "triton", "triton"),
], ids=lambda v: v if isinstance(v, str) else v[0])
def test_a_command_without_its_extra_names_the_extra(argv, missing, extra, monkeypatch, capsys, tmp_path):
    """Installed without an optional extra, a command that needs it exits 2 with one line that names
    the extra and the missing module, not a traceback. (A None in sys.modules is how Python marks a
    module that cannot be imported.)"""
    from lockstep import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, missing, None)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (f"lockstep {argv[0]}: needs the {extra} extra (pip install "
                                       f"'lockstep[{extra}]'): no module named {missing!r}\n")
    assert list(tmp_path.iterdir()) == []  # refused before it wrote anything
