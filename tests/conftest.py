import os
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


def pytest_collection_modifyitems(config, items):
    """GPU tests run wherever CUDA is present; elsewhere they are deselected and counted aloud."""
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        items[:] = [item for item in items if "gpu" not in item.keywords]
        config.hook.pytest_deselected(items=gpu)
        config._lockstep_gpu_deselected = len(gpu)


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
    """Whether stock fp32 F.linear at issue 27's shape gives other bits on 1 and 2 threads: what
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
    n = getattr(config, "_lockstep_gpu_deselected", 0)
    if n:
        terminalreporter.write_line(f"lockstep: {n} GPU tests deselected (no CUDA device on this machine)")
    # Which machine a run (CI's above all) landed on, since the BLAS's bits depend on it.
    follows = "differs" if _stock_linear_follows_threads() else "is the same"
    if os.environ.get("LOCKSTEP_TEST_REBLOCKING_BLAS"):
        follows += " (under the stand-in BLAS)"
    from lockstep.bench import cpu_name

    terminalreporter.write_line(f"lockstep: ran on {cpu_name()}, {os.cpu_count()} CPUs, ATen "
                                f"{torch.backends.cpu.get_cpu_capability()}; stock fp32 linear on 1 vs 2 "
                                f"threads {follows}")


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
