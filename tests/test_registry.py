"""Every op's faces are where its name says (docs/architecture.md), and contract.toml's tables say the
truth: which ops each backend implements, and the numbers docs/contract.md shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep import contract, ops, registry
from lockstep.harness import OWN_CHECKS
from lockstep.harness.specs import SPECS

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = sorted(contract.load()["backends"])
# Backend modules that hold shared kernels rather than one op (the Triton and native GEMMs, column sums, tile
# helpers, the native build and its recorded bits).
SHARED = {"triton": {"common", "gemm", "interpreter", "reduce"}, "native": {"bits", "build", "calls", "cpu", "gemm", "program", "rows", "silu",
                                                                    "unary"}}


def face(op: str) -> str:
    """The name under which an op's module, test and benchmark live (paged_attention is attention's)."""
    return contract.op_entry(op)["check"]


@pytest.mark.parametrize("op", registry.OPS)
def test_every_op_has_every_face(op):
    entry = contract.op_entry(op)
    assert entry["class"] in contract.load()["forward"], entry
    assert callable(getattr(ops, op)), f"lockstep.ops.{op}"
    assert (ROOT / f"src/lockstep/ops/{face(op)}.py").exists()
    assert face(op) in OWN_CHECKS or face(op) in SPECS, f"harness check of {op}"
    assert (ROOT / f"tests/test_{face(op)}.py").exists()
    assert (ROOT / f"benchmarks/bench_{face(op)}.py").exists()


def test_contract_names_every_op_and_nothing_else():
    assert set(contract.load()["ops"]) == set(registry.OPS)
    for backend in BACKENDS:
        assert set(contract.backend_ops(backend)) <= set(registry.OPS), backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_registers_exactly_the_ops_it_claims_each_in_its_own_module(backend):
    claimed = set(contract.backend_ops(backend))
    registered = registry.registered(backend)
    assert set(registered) == claimed, f"{backend}: registered {sorted(registered)}, contract.toml claims {sorted(claimed)}"
    for op, fn in registered.items():
        assert fn.__module__ == f"lockstep.backends.{backend}.{face(op)}", (op, fn.__module__)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_registers_exactly_the_ops_of_the_op_modules_it_holds(backend):
    held = {p.stem for p in (ROOT / f"src/lockstep/backends/{backend}").glob("*.py")}
    assert {registry.op_module(op) for op in registry.registered(backend)} == held & set(map(registry.op_module, registry.OPS))


def test_a_backend_is_the_op_modules_its_package_holds(tmp_path, monkeypatch):
    """The registry imports a backend's op modules by name, and no other module of its package; an op
    without a module runs on the fallback."""
    package = tmp_path / "lockstep_rope_only"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rope.py").write_text("from lockstep.registry import register\n\n"
                                     "@register('rope-only', 'rope')\ndef rope(*args):\n    return 'rope-only'\n")
    (package / "helpers.py").write_text("raise AssertionError('not an op module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register_backend("rope-only", "lockstep_rope_only", fallback="portable")
    assert list(registry.registered("rope-only")) == ["rope"]
    with registry.use_backend("rope-only"):
        assert registry.resolve("rope", torch.device("cpu"))() == "rope-only"
        assert registry.resolve("silu_mul", torch.device("cpu")) is registry.registered("portable")["silu_mul"]


def test_op_module_names_the_module_that_holds_an_op():
    assert registry.op_module("rope") == "rope" and registry.op_module("paged_attention") == "attention"
    with pytest.raises(ValueError, match=r"^op: unknown op 'softmax'; expected one of \['attention', "):
        registry.op_module("softmax")


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_module_is_an_op(backend):
    folder = ROOT / f"src/lockstep/backends/{backend}"
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"} - SHARED.get(backend, set())
    assert modules <= {face(op) for op in registry.OPS}, modules


def test_docs_tolerance_tables_match_contract_toml():
    """docs/contract.md repeats the numbers for the reader; contract.toml stays their one source."""
    text = (ROOT / "docs/contract.md").read_text()
    data = contract.load()
    rows = re.findall(r"^\| (\w+) \| [^|]+ \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", text, flags=re.M)
    forward = {cls: [c.strip() for c in cells] for cls, *cells in rows if cls in data["forward"]}
    assert set(forward) == set(data["forward"])

    def numbers(cell: str) -> list[float]:
        return [float(x) for x in cell.split("/")]

    for cls, cells in forward.items():
        want = [list(data["forward"][cls][d]) for d in ("float32", "bfloat16", "float16")]
        assert [numbers(c) for c in cells] == want, (cls, cells, want)
    gradient_rows = re.findall(r"^\| (\w+) \| ([\d.e/ -]+) \| ([\d.e/ -]+) \|$", text, flags=re.M)
    differing = {cls: [list(data["gradient"][cls][d]) for d in ("bfloat16", "float16")] for cls in data["gradient"]
                 if data["gradient"][cls] != data["forward"][cls]}
    assert {cls: [numbers(bf16), numbers(fp16)] for cls, bf16, fp16 in gradient_rows} == differing
    for cls in data["gradient"]:
        assert data["gradient"][cls]["float32"] == data["forward"][cls]["float32"], (cls, "docs/contract.md: fp32 "
                                                                                     "gradients use the forward's")


def test_check_of_a_backend_covers_exactly_its_ops():
    from lockstep import harness

    assert harness.checks_of("portable") == ["embedding", "rms_norm", "linear", "rope", "silu_mul", "gelu_mul", "log_softmax",
                                             "selected_logprobs", "vocab_logprobs", "cross_entropy", "attention",
                                             "masked_attention"]
    assert harness.checks_of("triton")[-2:] == ["attention", "masked_attention"]
    assert "attention" not in harness.checks_of("reference"), "attention's check needs paged_attention too"


def test_triton_interpreter_refusal_follows_the_measured_releases():
    from lockstep.backends import triton_interpreter_refusal

    refused = triton_interpreter_refusal("3.6.0", "2.4.6")
    assert refused == ("Triton 3.6.0's interpreter (TRITON_INTERPRET=1, the Triton backend without a GPU) cannot run "
                       "with numpy 2.4.6: its loops fail with 'only 0-dimensional arrays can be converted to Python "
                       "scalars'; install triton>=3.7 or numpy<2.4")
    assert triton_interpreter_refusal("3.6.0", "2.3.5") is None
    assert triton_interpreter_refusal("3.7.0", "2.4.6") is None and triton_interpreter_refusal("3.9.0", "2.4.6") is None
    assert triton_interpreter_refusal("3.6.0+git1234", "2.5.0rc1") is not None


def test_loading_triton_where_its_interpreter_cannot_run_names_the_releases():
    """Triton 3.6 with numpy 2.4 under the interpreter: loading the backend says why and what to
    install (not "pip install lockstep[triton]", which is installed), before any kernel fails."""
    child = ("import numpy, triton\nnumpy.__version__, triton.__version__ = '2.4.6', '3.6.0'\n"
             "from lockstep import registry\nregistry.load('triton')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        "lockstep.registry.BackendUnavailable: backend: 'triton' cannot be loaded: Triton 3.6.0's interpreter "
        "(TRITON_INTERPRET=1, the Triton backend without a GPU) cannot run with numpy 2.4.6: its loops fail with "
        "'only 0-dimensional arrays can be converted to Python scalars'; install triton>=3.7 or numpy<2.4")


def test_loading_triton_where_it_is_not_installed_says_how_to_install_it():
    child = "import sys\nsys.modules['triton'] = None\nfrom lockstep import registry\nregistry.load('triton')\n"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    last = out.stderr.splitlines()[-1]
    assert last.startswith("lockstep.registry.BackendUnavailable: backend: 'triton' cannot be loaded: ")
    assert last.endswith(" (pip install 'lockstep[triton]')")


def test_the_cpu_backends_kernel_set_is_the_native_one_and_the_block_forms_say_what_replaced_them():
    """The arithmetic around the ops takes the CPU backend's kernels as an argument
    (registry.cpu_backend_kernel_set: native where it builds). The names that selected the kernels
    for a block, per thread, stay importable (fixed_order's old path with its DeprecationWarning)
    and raise, naming the `kernels` argument that replaced them."""
    from lockstep.backends.native import cpu
    from lockstep.numerics import cpu_kernels, fixed_order

    assert registry.cpu_backend() == "native" and registry.cpu_backend_kernel_set() is cpu.KERNELS
    removed = {"numerics.cpu_kernels.cpu_kernels": lambda: cpu_kernels.cpu_kernels("native"),
               "numerics.cpu_kernels.current_cpu_kernels": cpu_kernels.current_cpu_kernels,
               "numerics.cpu_kernels.register_cpu_kernels": lambda: cpu_kernels.register_cpu_kernels(cpu.KERNELS),
               "numerics.cpu_kernels.records_cpu_kernels": lambda: cpu_kernels.records_cpu_kernels(len),
               "numerics.cpu_kernels.restores_cpu_kernels": lambda: cpu_kernels.restores_cpu_kernels(len),
               "numerics.cpu_kernels.selected_kernels": lambda: cpu_kernels.selected_kernels(torch.ones(1)),
               "backends.native.cpu.native_kernels": cpu.native_kernels,
               "registry.cpu_backend_kernels": registry.cpu_backend_kernels}
    for name, call in removed.items():
        with pytest.raises(RuntimeError, match=rf"^lockstep\.{re.escape(name)}: the CPU kernels are no longer selected "
                                               r"per thread; .*(`kernels`|kernels_for|on ctx)"):
            call()
    with pytest.warns(DeprecationWarning, match="has moved to lockstep.numerics.cpu_kernels"):
        assert fixed_order.cpu_kernels is cpu_kernels.cpu_kernels
    one = torch.ones(2, 3)
    assert cpu_kernels.kernels_for(cpu.KERNELS, one) is cpu.KERNELS and cpu_kernels.kernels_for(None, one) is None
    assert cpu_kernels.kernels_for(cpu.KERNELS, one.double()) is None
    assert cpu_kernels.kernels_for(cpu.KERNELS, one.double(), float64=True) is cpu.KERNELS
    assert cpu_kernels.columns_at_any_width(one, kernels=cpu.KERNELS) and not cpu_kernels.columns_at_any_width(one)
