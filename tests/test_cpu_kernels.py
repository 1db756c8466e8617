"""The suite's verdict must not depend on which CPU the machine has.

Libraries pick their kernels for the CPU they find: OpenBLAS (numpy's, so the Triton interpreter's)
by core type, ATen's vector loops by capability, MKL and oneDNN by instruction set. Each selection
is forced here through its environment variable, in a fresh process (tests/_kernel_probe.py), and
the invariance sweeps of the CPU's backend (native where it builds) must pass under every one the CPU
can run. (The portable backend's GEMMs are the BLAS's: on an Intel CPU, MKL's AVX2 path gives a row
alone other bits than in a batch, which is why native is the default; docs/adr/0010.) A selection this CPU
cannot run is reported as skipped with the missing instruction set, never dropped silently.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from _alongside import Alongside
from _kernel_probe import OPS

from lockstep.registry import cpu_backend

PROBE = Path(__file__).with_name("_kernel_probe.py")

# OpenBLAS core types of x86-64 and the CPU flags (/proc/cpuinfo) each one needs. Zen runs
# OpenBLAS's Haswell kernels, the ones whose bits move with a row's position in the tile.
CORETYPES = {
    "Prescott": {"pni"},
    "Nehalem": {"sse4_2"},
    "Sandybridge": {"avx"},
    "Haswell": {"avx2", "fma"},
    "Zen": {"avx2", "fma"},
    "SkylakeX": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"},
    "Cooperlake": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_bf16"},
}
ATEN_CAPABILITIES = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl"}}
MKL_ISAS = {"SSE4_2": {"sse4_2"}, "AVX": {"avx"}, "AVX2": {"avx2", "fma"}, "AVX512": {"avx512f", "avx512bw"}}
ONEDNN_ISAS = {"AVX2": {"avx2", "fma"}, "AVX512_CORE": {"avx512f", "avx512bw", "avx512dq", "avx512vl"},
               "AVX512_CORE_BF16": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"}}


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("flags", "vendor_id", ...); empty without it."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_vendor() -> str:
    """"GenuineIntel", "AuthenticAMD", or "" where /proc/cpuinfo does not say."""
    return _cpuinfo().get("vendor_id", "")


def require(flags: set[str]) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"these kernel selections are x86-64's; this machine is {platform.machine()}")
    missing = sorted(flags - cpu_flags())
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")


def _probe_command(env: dict[str, str], *args: str) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, "-W", "ignore", str(PROBE), *args], {**os.environ, "TRITON_INTERPRET": "1", **env}


def _verdicts(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe(env: dict[str, str], *args: str) -> dict:
    argv, full_env = _probe_command(env, *args)
    return _verdicts(subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=600))


@functools.cache
def effective_core(coretype: str) -> str | None:
    """The core OpenBLAS runs when asked for `coretype` (a build may map several names to one)."""
    code = "import sys; sys.path.insert(0, 'tests'); import _openblas as p; print(p.openblas_core())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OPENBLAS_CORETYPE": coretype},
                         capture_output=True, text=True, timeout=120, cwd=PROBE.parent.parent)
    return out.stdout.strip() or None


def _tested_as(coretype: str) -> str | None:
    """The earlier core type that already runs the core OpenBLAS runs for `coretype`, if any."""
    core = effective_core(coretype)
    earlier = [c for c in list(CORETYPES)[:list(CORETYPES).index(coretype)]
               if not (CORETYPES[c] - cpu_flags()) and effective_core(c) == core]
    return earlier[0] if core is not None and earlier else None


@pytest.fixture(scope="module")
def openblas_probes():
    """The sweeps under each core type this CPU runs and no earlier one stands for, side by side
    (tests/_alongside.py): the interpreter runs them on one core each."""
    runs = [c for c in CORETYPES if not (CORETYPES[c] - cpu_flags()) and _tested_as(c) is None]
    # fp32 only: the fixed-order dot widens bf16 tiles to fp32 before it multiplies them
    # (backends/triton/common.py), so bf16 reaches the same numpy kernels, and whatever of OpenBLAS
    # they use, as fp32 does. The --tl-dot test below still runs both dtypes.
    probes = Alongside({c: _probe_command({"OPENBLAS_CORETYPE": c}, "triton", "--dtypes", "float32") for c in runs})
    yield probes
    probes.stop()


@pytest.mark.parametrize("coretype", list(CORETYPES))
def test_triton_stand_in_is_invariant_under_every_openblas_core(coretype, openblas_probes):
    require(CORETYPES[coretype])
    earlier = _tested_as(coretype)
    if earlier:
        pytest.skip(f"OpenBLAS runs {coretype} as {effective_core(coretype)}, tested as {earlier}")
    result = _verdicts(openblas_probes.result(coretype))
    assert result["checked"] == [f"{op} torch.float32" for op in OPS["triton"]]
    assert not result["failures"], result


def test_sweeps_catch_the_interpreters_blas_dot():
    """With the interpreter's own tl.dot, OpenBLAS's Haswell kernel gives a row other bits at another
    position in the tile, and the sweeps must say so: they reach the case the fixed-order dot fixes."""
    require(CORETYPES["Haswell"])
    result = probe({"OPENBLAS_CORETYPE": "Haswell"}, "triton", "--tl-dot", "--ops", "linear")
    assert result["openblas_core"] in (None, "Haswell"), result
    assert any("reversed" in f for f in result["failures"]), result


@pytest.mark.parametrize("capability", list(ATEN_CAPABILITIES))
def test_the_cpu_backend_is_invariant_under_every_aten_capability(capability):
    require(ATEN_CAPABILITIES[capability])
    result = probe({"ATEN_CPU_CAPABILITY": capability}, cpu_backend())
    assert result["checked"] and not result["failures"], result


@pytest.mark.parametrize("isa", list(MKL_ISAS))
def test_the_cpu_backend_is_invariant_under_every_mkl_instruction_set(isa):
    require(MKL_ISAS[isa])
    result = probe({"MKL_ENABLE_INSTRUCTIONS": isa}, cpu_backend())
    assert result["checked"] and not result["failures"], result


@pytest.mark.parametrize("isa", list(ONEDNN_ISAS))
def test_the_cpu_backend_is_invariant_under_every_onednn_instruction_set(isa):
    require(ONEDNN_ISAS[isa])
    result = probe({"ONEDNN_MAX_CPU_ISA": isa}, cpu_backend())
    assert result["checked"] and not result["failures"], result
