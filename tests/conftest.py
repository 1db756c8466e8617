import os

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


def pytest_report_header(config):
    return f"lockstep: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_lockstep_gpu_deselected", 0)
    if n:
        terminalreporter.write_line(f"lockstep: {n} GPU tests deselected (no CUDA device on this machine)")


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
