"""The suite's own reporting, which the GPU machine's scripts (.ci/gpu, .ci/cpu-native) rely on."""

import json
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


def test_tests_that_share_an_expensive_fixture_run_on_one_worker_and_the_longest_first(tmp_path):
    """Under `make test`'s workers (tests/_scheduling.py) a module fixture of SHARED_FIXTURES is made
    once: the tests that use it form one unit on one worker. The heaviest unit (durations.json) starts
    first. xdist's own loadgroup split such tests across workers under pytest 9."""
    (tmp_path / "test_planted.py").write_text(
        "import os, pytest\n\n"
        "@pytest.fixture(scope='module')\n"
        "def wheel_install():\n"
        "    with open('made.txt', 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n\n"
        + "".join(f"def test_shares_{i}(wheel_install):\n    pass\n\n" for i in range(6))
        + "".join(f"def test_alone_{i}():\n    pass\n\n" for i in range(6)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "conftest", "--rootdir",
                          str(tmp_path), "-n", "2", str(tmp_path / "test_planted.py")],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert len((tmp_path / "made.txt").read_text().split()) == 1, out.stdout[-2000:]
    assert out.stdout.count("PASSED") == 12, out.stdout[-2000:]


def test_the_heaviest_unit_goes_first_and_the_audits_readers_last():
    import _scheduling
    from types import SimpleNamespace as Item

    known = json.loads(_scheduling.DURATIONS.read_text())
    slow = max(known, key=known.get)
    items = [Item(nodeid="tests/test_a.py::test_light", fixturenames=[]),
             Item(nodeid="tests/test_gpu_audit.py::test_reads", fixturenames=["gpu_audit_output"]),
             Item(nodeid="tests/test_b.py::test_one", fixturenames=["reduced_build"]),
             Item(nodeid=slow, fixturenames=[]),
             Item(nodeid="tests/test_b.py::test_two", fixturenames=["tmp_path", "reduced_build"])]
    units = _scheduling.order(items, last=lambda i: "gpu_audit_output" in i.fixturenames)
    assert [i.nodeid for i in items] == [slow, "tests/test_b.py::test_one", "tests/test_b.py::test_two",
                                         "tests/test_a.py::test_light", "tests/test_gpu_audit.py::test_reads"]
    assert units == {"tests/test_b.py::test_one": "tests/test_b.py::reduced_build",
                     "tests/test_b.py::test_two": "tests/test_b.py::reduced_build"}


def test_two_lanes_put_the_side_modules_on_one_worker_below_the_others(tmp_path):
    """`make test` on 2 cores (`-n 2 --lanes`, tests/_scheduling.py): the modules of SIDE_LANE run on
    one worker, which lowers its priority to SIDE_NICE; every other test runs on the other worker, at
    the priority the run started with."""
    import _scheduling

    side = sorted(_scheduling.SIDE_LANE)[0]
    body = ("import os\n\n"
            + "".join(f"def test_{i}():\n    with open({str(tmp_path / 'ran.txt')!r}, 'a') as f:\n"
                      f"        f.write(f\"{{__name__}} {{os.environ['PYTEST_XDIST_WORKER']}} {{os.nice(0)}}\\n\")\n\n"
                      for i in range(4)))
    (tmp_path / "tests").mkdir()
    (tmp_path / side).write_text(body)
    (tmp_path / "tests" / "test_main_lane.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "--rootdir",
                          str(tmp_path), "-n", "2", "--lanes", "tests"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    lanes = {module: {(worker, nice) for m, worker, nice in ran if m == module} for module, _, _ in ran}
    start = os.nice(0)
    side_module = Path(side).stem
    assert len(ran) == 8 and len(lanes[side_module]) == 1 and len(lanes["test_main_lane"]) == 1, ran
    (side_worker, side_nice), = lanes[side_module]
    (main_worker, main_nice), = lanes["test_main_lane"]
    assert side_worker != main_worker and int(main_nice) == start
    assert int(side_nice) == max(start, _scheduling.SIDE_NICE), ran
    # Lanes need their two workers.
    alone = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                            "--rootdir", str(tmp_path), "--lanes", "tests"],
                           env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert alone.returncode == 4 and "--lanes: expected -n 2 (two pytest-xdist workers, one lane each)" in alone.stderr, \
        alone.stderr[-2000:]
