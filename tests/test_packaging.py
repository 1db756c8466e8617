"""The installed package, as a user gets it from a wheel: every file it reads at run time is inside,
and the native backend builds from it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "lockstep"


def test_a_wheel_holds_every_file_of_the_package_and_runs_the_native_backend(tmp_path):
    """`pip wheel .` packs every file under src/lockstep that is not Python (the contract, the
    native kernels' source); installed from that wheel alone, lockstep compiles the kernels and
    runs the native backend, not the portable fallback."""
    # Built from a copy: a build writes build/ and *.egg-info beside its source.
    tree = tmp_path / "tree"
    shutil.copytree(PACKAGE.parent, tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "dist"), str(tree)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("lockstep-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    assert {"lockstep/contract.toml", "lockstep/backends/native/kernels.c"} <= data
    assert data <= names, sorted(data - names)

    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    code = ("import torch, lockstep\nfrom lockstep import ops, registry\n"
            "print(lockstep.__file__)\nprint(registry.cpu_backend())\n"
            "print(ops.linear(torch.ones(2, 3), torch.ones(4, 3)).sum().item())\n")
    env = {**os.environ, "PYTHONPATH": str(site), "LOCKSTEP_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, backend, total = proc.stdout.split()
    assert Path(where).is_relative_to(site), where
    assert backend == "native", proc.stderr
    assert float(total) == 24.0
    assert "native CPU backend is not in use" not in proc.stderr
