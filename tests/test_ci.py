"""The suite's own reporting, which the GPU machine's scripts (.ci/gpu, .ci/cpu-native) rely on."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failure_is_logged_as_it_happens(tmp_path, workers):
    """LOCKSTEP_FAILURE_LOG (tests/conftest.py): a failing test's report lands in the file once, under
    pytest-xdist's workers too (as .ci/cpu-native and .ci/cpu-suite run), and a passing one's does
    not, so a run cut short by a time limit still says why what failed failed."""
    (tmp_path / "test_planted.py").write_text("def test_fails():\n    assert 1 == 2, 'planted'\n\n"
                                               "def test_passes():\n    pass\n")
    log = tmp_path / "failures.txt"
    path = os.pathsep.join([str(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "LOCKSTEP_FAILURE_LOG": str(log), "PYTHONPATH": path}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          "--rootdir", str(tmp_path), *(["-n", str(workers)] if workers else []),
                          str(tmp_path / "test_planted.py")],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    text = log.read_text()
    assert text.startswith("==== test_planted.py::test_fails (call)\n") and "AssertionError: planted" in text
    assert text.count("==== ") == 1 and "test_passes" not in text
