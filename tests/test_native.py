"""The native backend (docs/adr/0010-native-cpu-backend.md): one set of bits for every instruction
set, thread count and BLAS selection, and a fallback that says why it is taken.

The op-by-op invariance sweeps (rows, batch composition, padding, chunking, paged decode) run on
the native backend in each op's own test file, since it is the CPU's default backend."""

from __future__ import annotations

import decimal
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from lockstep.tools import bench
from lockstep.numerics import exact_math, fixed_order
from lockstep import ops, registry
from lockstep.tools import backend_bits
from lockstep.backends.native import bits, build, gemm, masked_attention, unary
from lockstep.backends.native.cpu import native_kernels
from lockstep.model import ModelConfig, Transformer
from lockstep.harness.check import num_threads

from test_cpu_kernels import ATEN_CAPABILITIES, MKL_ISAS, ONEDNN_ISAS, cpu_flags, cpu_vendor, require

ROOT = Path(__file__).resolve().parent.parent
DIGEST = Path(__file__).with_name("_native_digest.py")
ISA_FLAGS = {"scalar": set(), "avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512vl"},
             "avx512bf16": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def digest(env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", str(DIGEST)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def widest() -> dict:
    return digest({})


@pytest.fixture
def isa(monkeypatch):
    """Force an instruction set in this process (build.isa reads LOCKSTEP_CPU_ISA at every call).
    Tests loop over build.supported_isas(), so a CPU without some path (AVX512_BF16 on most Intel
    Xeons) compares the paths it has instead of skipping the test."""
    def force(name: str) -> None:
        require(ISA_FLAGS[name])
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", name)
    return force


def test_every_thread_count_gives_one_digest(widest):
    assert len({json.dumps(d, sort_keys=True) for d in widest["digests"].values()}) == 1, widest


def test_the_kernels_give_the_recorded_bits_on_every_instruction_set():
    """Every kernel, through ctypes on inputs that no floating-point library touches
    (lockstep.backends.native.bits), gives on every instruction set this CPU runs the bits that
    recorded_bits.json holds: those of the machine where they were recorded, whatever this CPU's
    maker (other thread counts are tied to these by
    test_the_torch_free_digest_is_one_on_every_instruction_set_and_thread_count). `lockstep check`
    runs the same comparison."""
    recorded = bits.recorded()
    differ = bits.compare(recorded["kernels"])
    if any(differ.values()):
        pytest.fail(bits.mismatch(f"The kernels on {bench.machine()}", differ, recorded["recorded_on"]), pytrace=False)


def test_the_native_backend_gives_the_recorded_bits(widest):
    """Every op forward and backward in fp32, bf16 and fp16, attention's forms, two trainer steps,
    the model's own arithmetic and a random model's weights (backend_bits through tests/_native_digest.py,
    1 thread, the widest instruction set) give the bits that recorded_bits.json holds. torch's own exact ops and
    generators build the inputs and the arithmetic around the kernels, so the file lists the torch
    releases found to give those bits; under another the comparison still runs, and a failure says
    that the release may be why."""
    recorded = bits.recorded()
    differ = bits.differing(widest["digests"]["1"], recorded["native_backend"])
    if differ:
        listed = backend_bits.release(torch.__version__) in recorded["torch"]
        generators = ("torch's generators draw other numbers here than where the bits were recorded, so every input "
                      "differs; suspect this torch build or C library first. ") if backend_bits.GENERATORS in differ else ""
        pytest.fail(generators + ("" if listed else (
                        f"This runs torch {torch.__version__}, and the recorded bits were found under torch "
                        f"{', '.join(recorded['torch'])} only: another release's generators and ops may give other "
                        "inputs, so check that first. "))
                    + bits.mismatch(f"The native backend on {bench.machine()}", {widest["isa"]: differ},
                                    recorded["recorded_on"])
                    + ". Where the kernels give the recorded bits (the test above) and every op section differs, "
                      "suspect the inputs: torch's float64 randn takes the C library's log and cos (docs/adr/0026)",
                    pytrace=False)


def test_the_recording_holds_the_torch_release_the_makefile_pins():
    """The suite runs under the Makefile's torch, so the recording must have been checked under it."""
    pin = re.search(r"torch==([0-9.]+)", (ROOT / "Makefile").read_text())
    assert pin, "the Makefile no longer installs torch==X.Y.Z"
    pin = pin.group(1)
    releases = bits.recorded()["torch"]
    assert pin in releases, (f"recorded_bits.json lists torch {releases}, not the Makefile's torch=={pin}: run "
                             "python tests/_native_digest.py --record under it")


def test_record_measures_the_bits_the_tests_compare(widest):
    """--record writes the whole backend's bits that the test above compares (1 thread) and the
    kernels' of this CPU's widest instruction set, under this torch release."""
    import _native_digest

    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        now = _native_digest.measure()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    assert now["native_backend"] == widest["digests"]["1"]
    assert now["torch"] == [backend_bits.release(torch.__version__)]


def test_the_whole_backend_digest_runs_the_native_backend_whatever_is_selected(widest):
    """`lockstep check` may run under another selected backend, and a caller without gradients."""
    with registry.use_backend("portable"), torch.no_grad():
        assert backend_bits.digests() == widest["digests"]["1"]


def test_record_adds_a_release_only_where_its_bits_are_the_recorded_ones():
    """merge() (--record): the same bits under another release add it, in version order, once, and keep
    the machine the file names (a version string, the file's first form, counts as its release);
    other bits under a listed release replace the recording and drop the other releases; other bits
    under an unlisted release are refused, unless replaced on purpose."""
    from _native_digest import merge

    kernels, backend = {"gemm": "a"}, {"training": "b"}
    now = {"about": "new", "recorded_on": {"machine": "here", "isa": "avx2"}, "torch": ["2.10.0"], "kernels": kernels,
           "native_backend": backend}
    file = {"about": "old", "recorded_on": {"machine": "there", "isa": "scalar"}, "torch": ["2.9.1", "2.11.0"],
            "kernels": kernels, "native_backend": backend}
    data, dropped = merge(file, now)
    assert (data["torch"], data["recorded_on"]["machine"], data["about"], dropped) == (
        ["2.9.1", "2.10.0", "2.11.0"], "there", "new", [])
    assert merge({**file, "torch": "2.10.0+cpu"}, now)[0]["torch"] == ["2.10.0"]
    assert merge({**file, "torch": ["2.10.0+cpu", "2.9.1"]}, now)[0]["torch"] == ["2.9.1", "2.10.0"]
    assert merge(None, now) == (now, [])

    listed = {**now, "torch": ["2.11.0"], "native_backend": {"training": "c"}}
    assert merge(file, listed) == (listed, ["2.9.1"])
    other = {**now, "native_backend": {"training": "c"}}
    with pytest.raises(ValueError, match=r"^torch 2\.10\.0 is not among the recording's releases \(torch 2\.9\.1, "
                                         r"2\.11\.0\) and gives other bits: the whole backend differs in training, "
                                         r"and another release's generators .* --replace records these bits"):
        merge(file, other)
    with pytest.raises(ValueError, match=r"the kernels differ \(gemm\), which no torch release touches"):
        merge(file, {**other, "kernels": {"gemm": "z"}})
    assert merge(file, other, replace=True) == (other, ["2.9.1", "2.11.0"])


@pytest.mark.parametrize("name", list(build.ISAS))
def test_every_instruction_set_gives_the_same_bits_for_every_op(name, widest):
    """Every op forward and backward, fp32, bf16 and fp16, on 1, 2 and 3 threads, in a process that
    runs only instruction set `name`: one digest."""
    require(ISA_FLAGS[name])
    got = digest({"LOCKSTEP_CPU_ISA": name})
    assert got["isa"] == name
    assert got["digests"] == widest["digests"]


def test_threads_come_from_torchs_openmp_runtime_or_the_librarys_own_with_the_same_bits(widest):
    """torch's OpenMP threads run the kernels' parallel work where torch has an OpenMP runtime (the
    pip wheels' libgomp); LOCKSTEP_NATIVE_POOL=own forces the library's threads. One digest."""
    runtime = build.openmp_runtime()
    assert widest["pool"] == ("openmp" if runtime else "own"), runtime
    own = digest({"LOCKSTEP_NATIVE_POOL": "own"})
    assert own["pool"] == "own"
    assert own["digests"] == widest["digests"]


def test_a_second_compiler_gives_the_same_bits_on_every_instruction_set(tmp_path, widest):
    """kernels.c built by clang (LLVM, from the ziglang package, a test dependency) instead of the
    machine's cc: every op of the digest, forward and backward, in fp32, bf16 and fp16, on 1, 2 and
    3 threads and every instruction set this CPU runs, gives the first build's bits. Unforced, the
    clang build picks the same widest instruction set: its CPU detection does not lean on the
    compiler's runtime library (zig's leaves __builtin_cpu_supports' table empty)."""
    env = {"CC": f"{shlex.quote(sys.executable)} -m ziglang cc", "LOCKSTEP_CACHE_DIR": str(tmp_path)}
    got = digest(env)
    assert "clang" in got["compiler"] and got["compiler"] != widest["compiler"], (got["compiler"], widest["compiler"])
    assert got["isa"] == widest["isa"]
    assert got["digests"] == widest["digests"]
    for name in build.supported_isas()[:-1]:
        forced = digest({**env, "LOCKSTEP_CPU_ISA": name})
        assert forced["isa"] == name
        assert forced["digests"] == widest["digests"], name
    assert len(list(tmp_path.glob("native-*.so"))) == 1  # one build, by clang, ran every digest


def test_the_instruction_sets_found_are_the_ones_the_cpu_reports():
    """kernels.c reads CPUID and XGETBV itself; it finds what the OS's /proc/cpuinfo flags report
    (AVX512_BF16 also needs VDPBF16PS to pass the self-test against the bf16 order)."""
    require(set())
    want = [name for name, flags in ISA_FLAGS.items() if flags <= cpu_flags()]
    got = build.supported_isas()
    assert got == want or (want[-1] == "avx512bf16" and got == want[:-1]), (got, want)
    assert build.unbuilt_isas() == []  # the machine's compiler built the whole file (BUILDS' first)


def test_cc_is_a_command_and_a_missing_one_is_named(monkeypatch):
    monkeypatch.setenv("CC", f"{shlex.quote(sys.executable)} -m ziglang cc")
    assert build.compiler() == [shutil.which(sys.executable), "-m", "ziglang", "cc"]
    monkeypatch.setenv("CC", "no-such-cc --flag")
    with pytest.raises(build.NativeUnavailable, match=r"CC='no-such-cc --flag': 'no-such-cc' was not found on PATH"):
        build.compiler()
    monkeypatch.setenv("CC", '"gcc')
    with pytest.raises(build.NativeUnavailable, match=r"""CC='"gcc' cannot be split into a command: No closing"""):
        build.compiler()


def test_arguments_in_cc_build_their_own_file():
    """The cache key holds CC's whole command: `cc -DLS_NO_X86` must not load the file `cc` built."""
    cc = [shutil.which("cc") or shutil.which("gcc")]
    assert build.cached_library(cc) != build.cached_library([*cc, "-DLS_NO_X86"])
    assert build.cached_library(cc) == build.cached_library(list(cc))


@pytest.mark.parametrize("target", ["aarch64-linux-gnu", "x86_64-macos", "aarch64-macos", "x86_64-linux-musl"])
def test_the_kernels_compile_for_other_platforms(target, tmp_path):
    """kernels.c compiles, with the build's flags and warnings as errors, for ARM Linux, both Macs
    and musl (zig's clang cross-compiles): no x86 code outside its guards, no glibc-only call. This
    says nothing of the bits there; only x86-64 Linux has run them."""
    obj = tmp_path / "kernels.o"
    flags = [f for f in build.FLAGS if f != "-shared"]
    done = subprocess.run([sys.executable, "-m", "ziglang", "cc", "-target", target, *flags, "-Wall", "-Werror", "-c",
                           "-o", str(obj), str(build.SOURCE)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert obj.stat().st_size > 0


def test_the_torch_free_digest_is_one_on_every_instruction_set_and_thread_count():
    """lockstep.backends.native.bits calls the kernels through ctypes on numpy buffers, so that it can run
    where torch cannot (under QEMU for aarch64, below). Here it gives one digest per op on every
    instruction set and thread count; every op of it runs on several threads (counted through a
    stand-in for OpenMP's entry point, which runs a region's team on one thread, with the same
    bits); and its GEMM call is the one torch's wrapper makes."""
    import ctypes
    import hashlib

    import numpy as np

    lib, digests = build.library(), {}
    for name in build.supported_isas():
        for threads in (1, 2, 3):
            digests[name, threads] = bits.digests(lib, build.ISAS[name], threads)
    assert len({json.dumps(d, sort_keys=True) for d in digests.values()}) == 1, digests
    teams, body = [], ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
    def parallel(fn, data, team, flags):  # GOMP_parallel's signature
        teams.append(team)
        body(fn)(data)

    lib.ls_use_openmp(ctypes.cast(parallel, ctypes.c_void_p))
    try:
        run = bits.Run(lib, build.isa(), 3)
        for name in bits.OPS:
            teams.clear()
            h = hashlib.sha256()
            getattr(run, name)(h)
            assert any(team > 1 for team in teams), (name, teams)
            assert h.hexdigest() == digests[build.isa_name(), 3][name], name
    finally:
        lib.ls_use_openmp(build._gomp_parallel(build._pool_asked()))
    run = bits.Run(lib, build.isa(), 2)
    a, b = (bits.values(run.rng, rows * 129, bits.BF16) for rows in (5, 40))
    out = np.zeros(5 * 40, dtype=np.float32)
    run.check(lib.ls_gemm_nt(1, 5, 40, 129, a.ctypes.data, 129, 0, b.ctypes.data, 129, 0, out.ctypes.data, 40, 0, None,
                             bits.BF16, bits.F32, 1, run.isa, 2), "ls_gemm_nt")
    ta, tb = (torch.from_numpy(x).view(torch.bfloat16).view(-1, 129) for x in (a, b))
    assert torch.equal(torch.from_numpy(out).view(5, 40), gemm.gemm_nt(ta[:5], tb[:40]))


def _require_tools(missing: list[str], what: str, how: str) -> None:
    """Skip a test that runs under QEMU when `missing` names what it lacks, with the command that
    makes it; fail instead under LOCKSTEP_REQUIRE_QEMU, which .ci/run sets after making it all."""
    if not missing:
        return
    # LOCKSTEP_REQUIRE_ARM is the earlier name, from before the emulated Intel CPUs.
    required = [name for name in ("LOCKSTEP_REQUIRE_QEMU", "LOCKSTEP_REQUIRE_ARM") if os.environ.get(name)]
    if required:
        pytest.fail(f"{required[0]} is set but {', '.join(missing)} is missing ({how})")
    pytest.skip(f"no {what} ({', '.join(missing)}): {how}; .ci/run does it and requires this test")


def _arm_user_space() -> Path:
    """The aarch64 user space that .ci/arm-sysroot makes (LOCKSTEP_ARM_SYSROOT), with qemu-aarch64
    and GCC's aarch64 cross compiler on PATH."""
    folder = os.environ.get("LOCKSTEP_ARM_SYSROOT")
    _require_tools([what for what, ok in [("LOCKSTEP_ARM_SYSROOT", folder and Path(folder, "usr/bin/python3").exists()),
                                          ("qemu-aarch64", shutil.which("qemu-aarch64")),
                                          ("aarch64-linux-gnu-gcc", shutil.which("aarch64-linux-gnu-gcc"))] if not ok],
                   "aarch64 user space", ".ci/arm-sysroot FOLDER makes one (root, apt), and LOCKSTEP_ARM_SYSROOT=FOLDER "
                   "runs this")
    return Path(folder)


@pytest.mark.parametrize("cross", ["clang", "gcc"])
def test_an_aarch64_build_under_qemu_gives_the_x86_bits(cross, tmp_path):
    """kernels.c built for aarch64 Linux (the scalar path, as on every ARM CPU) by clang (zig's) or
    GCC's cross compiler, with the build's flags, and run under QEMU's user-mode emulation of an
    aarch64 CPU: every op of lockstep.backends.native.bits, on 1, 2 and 3 threads, gives the digest of the
    x86 paths here. QEMU emulates AArch64's floating point to the architecture's rules; no ARM
    hardware has run it, and torch's own ops on ARM are not covered."""
    root = _arm_user_space()
    so = tmp_path / "kernels-aarch64.so"
    cc = ([sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu.2.36"] if cross == "clang"
          else ["aarch64-linux-gnu-gcc"])
    done = subprocess.run(build.compile_command(cc, [], str(so)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.run(["qemu-aarch64", "-L", str(root), "-E", f"PYTHONPATH={root / 'site'}",
                           str(root / "usr/bin/python3"), str(Path(bits.__file__)), str(so)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["isa"] == "scalar"
    want = bits.digests(build.library(), build.isa(), 2)
    assert got["digests"] == {str(t): want for t in (1, 2, 3)}


def _qemu_x86() -> str:
    """The path of qemu-x86_64 (qemu-user; .ci/arm-sysroot installs it)."""
    qemu = shutil.which("qemu-x86_64")
    _require_tools([] if qemu else ["qemu-x86_64"], "x86-64 emulator",
                   "apt-get install qemu-user (.ci/arm-sysroot installs it)")
    return qemu


# QEMU's models of Intel CPUs (GenuineIntel in CPUID, so MKL takes its Intel code paths) that TCG can
# run: Haswell (AVX2 and FMA, no AVX-512) and Sandy Bridge (AVX alone, below what the AVX2 path needs),
# with the thread counts each runs. Haswell's MKL re-blocks with the thread count (the Xeon's fault),
# so it runs three; Sandy Bridge adds the scalar path and ATen's default kernels, on 2 threads, since
# TCG runs scalar arithmetic one helper call an element (about 95 s a thread count on 2 Zen 4 cores).
INTEL_CPUS = {"Haswell-v4": ("avx2", "AVX2", "1,2,3"), "SandyBridge": ("scalar", "DEFAULT", "2")}
# On a GenuineIntel host MKL takes its Intel paths without an emulator, and Haswell's are reached by
# capping each library at AVX2: 7 s there against 11 minutes of TCG on a 2-core Xeon (ADR 0029's
# later section). Sandy Bridge stays emulated everywhere: only a CPU without AVX2 and FMA shows that
# the scalar path executes none of their instructions.
NATIVE_CAPS = {"Haswell-v4": {"LOCKSTEP_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                              "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def _as_intel_cpu(model: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The command prefix and environment that run a process on `model`'s code paths: natively with
    each library capped (NATIVE_CAPS) on a GenuineIntel host that runs AVX2, else under QEMU's model
    of that CPU."""
    if model in NATIVE_CAPS and cpu_vendor() == "GenuineIntel" and ISA_FLAGS["avx2"] <= cpu_flags():
        return (), {**os.environ, **NATIVE_CAPS[model]}
    return (_qemu_x86(), "-cpu", model), dict(os.environ)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates x86-64 CPUs in user mode; CI runs x86-64")
@pytest.mark.parametrize("model", list(INTEL_CPUS))
def test_an_emulated_intel_cpu_gives_the_bits_of_this_one(model, widest):
    """The issue's Xeon failure came from MKL's Intel code paths, which re-block fp32 GEMMs with the
    thread count; they run only where CPUID says GenuineIntel. Under QEMU's user-mode emulation of an
    Intel CPU they run here: stock fp32 `F.linear` on Haswell gives other bits on 1 and 2 threads
    (checked first, so the emulation is known to reach them). The native backend, whose instruction
    set is the one it finds in that CPUID (AVX2; scalar on Sandy Bridge, with ATen's default
    kernels), gives this machine's digest: every op, forward and backward, fp32, bf16 and fp16, two
    trainer steps (AdamW's root included) and a random model's weights, on 1, 2 and 3 threads
    (Sandy Bridge on 2: INTEL_CPUS). TCG has no AVX-512, so the AVX-512 paths on Intel run only on
    hardware. On a GenuineIntel host with AVX2, Haswell's paths run natively instead, each library
    capped at AVX2 (NATIVE_CAPS): the instruction set is then forced, not found, and an AVX-512
    instruction on the AVX2 path would not trap there (an AMD host's QEMU run shows both)."""
    isa, aten, threads = INTEL_CPUS[model]
    emulator, env = _as_intel_cpu(model)
    proc = subprocess.run([*emulator, sys.executable, "-W", "ignore", str(DIGEST), "--threads", threads],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["isa"], got["aten"]) == (isa, aten)
    if model == "Haswell-v4":
        assert got["stock_linear"]["1"] != got["stock_linear"]["2"], "MKL's Intel path did not re-block"
    assert got["digests"] == {n: widest["digests"][n] for n in threads.split(",")}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates x86-64 CPUs in user mode; CI runs x86-64")
def test_on_an_emulated_intel_cpu_the_fallback_line_says_what_the_portable_backend_loses(tmp_path):
    """On QEMU's Haswell, MKL's fp32 GEMM changes a row's bits with the tile's row count and a
    column's with the call's width, the two premises of the portable backend's invariance: without
    a compiler, the line that says why the native backend is not in use also says that, and so does
    `lockstep check --backend portable`, whose batch sweep fails there. On a GenuineIntel host with
    AVX2, MKL's AVX2 path runs natively instead (NATIVE_CAPS), with the same verdicts; uncapped, MKL's
    AVX-512 path breaks the row tiles alone, so the column widths here also show that the cap took."""
    emulator, env = _as_intel_cpu("Haswell-v4")  # QEMU by its full path: PATH is emptied for the child
    caveat = ("PyTorch's fp32 GEMMs here break the row tiles and column widths that the portable backend rests on, "
              "so it has no batch invariance or tensor-parallel invariance on this machine at 2 threads "
              "(docs/contract.md, section 7)")
    assert _fallback_lines(tmp_path, emulator, env) == [f"{FALLBACK_LINE}; {caveat}"]
    check = subprocess.run([*emulator, sys.executable, "-m", "lockstep", "check", "--backend", "portable", "linear",
                            "--dtype", "fp32", "--no-grad"], env={**env, "OMP_NUM_THREADS": "2"},
                           capture_output=True, text=True, timeout=600)
    assert check.returncode == 1, check.stderr[-3000:]
    first, *_, row, _, summary = check.stdout.splitlines()
    assert first.startswith("lockstep check: backend=portable threads=2 ") and first.endswith(f"; {caveat}"), first
    assert row.split()[:2] == ["linear", "float32"] and "FAIL batch=1" in row, row
    assert summary.startswith("0 passed, 1 failed"), summary


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only; CI runs Linux")
def test_a_forked_child_runs_the_kernels_on_several_threads():
    """libgomp's threads do not exist in a forked child, and a parallel region there never ends
    (torch's own ops hang so); the kernels switch to their own threads in the child. The child
    stays away from torch ops that run on OpenMP (it compares bytes, not tensors)."""
    torch.set_num_threads(2)
    a, b = torch.randn(256, 512), torch.randn(300, 512)
    want = gemm.gemm_nt(a, b).numpy().tobytes()
    pid = os.fork()
    if pid == 0:
        code = 0 if gemm.gemm_nt(a, b).numpy().tobytes() == want else 3
        os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's GEMM did not finish in 60 s")


def test_a_forced_pool_must_be_known(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_NATIVE_POOL", "tbb")
    with pytest.raises(ValueError, match=r"LOCKSTEP_NATIVE_POOL: expected one of \['openmp', 'own'\], got 'tbb'"):
        build.pool_name()


@pytest.mark.parametrize("env", [{"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"},
                                 {"ATEN_CPU_CAPABILITY": "default"}], ids=lambda e: "=".join(*e.items()))
def test_the_bits_do_not_follow_pytorchs_kernel_selection(env, widest):
    """MKL's and oneDNN's instruction sets and ATen's vector capability move the portable backend's
    bits (fp32 GEMMs, and exp and log through MKL's vector math); the native backend's stay."""
    (key, value), = env.items()
    table = {"MKL_ENABLE_INSTRUCTIONS": MKL_ISAS, "ONEDNN_MAX_CPU_ISA": ONEDNN_ISAS,
             "ATEN_CPU_CAPABILITY": ATEN_CAPABILITIES}[key]
    require(table[value])
    assert digest(env)["digests"] == widest["digests"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1029, 4133], ids=lambda k: f"K={k}")
def test_gemm_bits_across_instruction_sets_threads_rows_and_tails(dtype, k, isa):
    """K = 1029 and 4133 leave a tail in every lane width (4133: rows of 8 KB or more, which the
    kernel runs in blocks of K); 37 x 301 outputs leave partial micro-tiles and items; big enough to
    run on several threads."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, k, generator=gen).to(dtype)
    b = torch.randn(301, k, generator=gen).to(dtype)
    bias = torch.randn(301, generator=gen)
    outs = []
    for name in build.supported_isas():
        isa(name)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(gemm.gemm_nt(a, b, bias))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # A row's and a column's bits do not depend on the others in the call.
    assert torch.equal(gemm.gemm_nt(a[5:6], b, bias), outs[0][5:6])
    assert torch.equal(gemm.gemm_nt(a, b[7:9], bias[7:9]), outs[0][:, 7:9])
    ref = a.double() @ b.double().t() + bias.double()
    assert (outs[0].double() - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 3), (torch.float16, 6)], ids=str)
def test_gemm_order_is_the_documented_one(dtype, rows):
    """kernels.c's order, restated in Python: 16 lanes over K, each one fp32 FMA chain from k = 0
    (emulated exactly in float64 then rounded, as an FMA rounds once), folded by the fixed tree
    (in vector form on AVX2 and AVX-512). fp16 operands are widened exactly first; more rows than
    one micro-tile. (bf16 has its own order: test_bf16_gemm_order_is_the_documented_one.)"""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(rows, 45, generator=gen).to(dtype)
    b = torch.randn(2, 45, generator=gen).to(dtype)
    got = gemm.gemm_nt(a, b)
    assert torch.equal(gemm.gemm_nt(a[:1], b)[0], got[0])
    for m in range(rows):
        for n in range(2):
            lanes = [torch.tensor(0.0)] * 16
            for k in range(45):
                j = k % 16
                lanes[j] = (lanes[j].double() + a[m, k].double() * b[n, k].double()).float()
            t = [lanes[j] + lanes[j + 8] for j in range(8)]
            u = [t[j] + t[j + 4] for j in range(4)]
            v = [u[j] + u[j + 2] for j in range(2)]
            assert torch.equal(got[m, n], v[0] + v[1]), (m, n)


def _fma64(a: float, b: float, s: float) -> float:
    """float64 fma: the exact a * b + s (Fractions), rounded once (float() of a Fraction rounds to nearest even)."""
    return float(Fraction(a) * Fraction(b) + Fraction(s))


def test_float64_gemm_order_is_the_documented_one(monkeypatch):
    """float64 takes the fp32 order in double precision (docs/adr/0027), restated in Python: 16
    lanes over K, each one float64 FMA chain from k = 0 (emulated exactly with Fractions), folded by
    the fixed tree, the bias added once after it. K = 45 leaves a tail; 3 x 5 outputs leave partial
    micro-tiles; in every instruction set, with one row or one column alone."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 45, generator=gen, dtype=torch.float64)
    b = torch.randn(5, 45, generator=gen, dtype=torch.float64)
    bias = torch.randn(5, generator=gen, dtype=torch.float64)
    got = gemm.gemm_nt(a, b, bias, out_dtype=torch.float64)
    for m in range(3):
        for n in range(5):
            lanes = [0.0] * 16
            for k in range(45):
                lanes[k % 16] = _fma64(a[m, k].item(), b[n, k].item(), lanes[k % 16])
            t = [lanes[j] + lanes[j + 8] for j in range(8)]
            u = [t[j] + t[j + 4] for j in range(4)]
            v = [u[j] + u[j + 2] for j in range(2)]
            assert got[m, n].item() == (v[0] + v[1]) + bias[n].item(), (m, n)
    for name in build.supported_isas():
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", name)
        assert torch.equal(gemm.gemm_nt(a, b, bias, out_dtype=torch.float64), got), name
        assert torch.equal(gemm.gemm_nt(a[1:2], b, bias, out_dtype=torch.float64), got[1:2]), name
        assert torch.equal(gemm.gemm_nt(a, b[3:4], bias[3:4], out_dtype=torch.float64), got[:, 3:4]), name
    # Row and batch strides other than K and M K, and an output wider than N, as the kernel reads them.
    a2, b2 = torch.randn(3, 45, generator=gen, dtype=torch.float64), torch.randn(5, 45, generator=gen, dtype=torch.float64)
    spaced_a, spaced_b = torch.zeros(2, 4, 50, dtype=torch.float64), torch.zeros(2, 6, 47, dtype=torch.float64)
    spaced_a[0, :3, :45], spaced_a[1, :3, :45], spaced_b[0, :5, :45], spaced_b[1, :5, :45] = a, a2, b, b2
    out = torch.full((2, 3, 9), math.nan, dtype=torch.float64)
    gemm.gemm_nt(spaced_a[:, :3, :45], spaced_b[:, :5, :45], out=out[:, :, 2:7], out_dtype=torch.float64)
    assert torch.equal(out[0, :, 2:7], gemm.gemm_nt(a, b, out_dtype=torch.float64))
    assert torch.equal(out[1, :, 2:7], gemm.gemm_nt(a2, b2, out_dtype=torch.float64))
    assert out[:, :, :2].isnan().all() and out[:, :, 7:].isnan().all()
    lib, code = build.library(), build.isa()
    x = torch.ones(4, dtype=torch.float64)
    assert lib.ls_unary_f64(x.data_ptr(), x.data_ptr(), 4, 3, code, 1) == -1            # no function 3
    assert lib.ls_unary_f64(x.data_ptr(), x.data_ptr(), -1, 0, code, 1) == -1
    assert lib.ls_gemm_nt_f64(1, -1, 1, 1, x.data_ptr(), 1, 0, x.data_ptr(), 1, 0, x.data_ptr(), 1, 0, None, code,
                              1) == -1


def test_float64_on_the_native_backend_keeps_every_invariance():
    """Section 2 for float64 on the native backend (docs/adr/0027), bitwise: every op's layout sweeps
    (other batches, padding and NaN rows, strided, repeat, 1 vs 2 threads), attention's (alone,
    reversed, beside NaN sequences, padding, chunked prefill, paged decode) and masked attention's.
    On PyTorch's float64 GEMMs these follow the BLAS (under QEMU's Haswell: the thread count and the
    row count). The contract has no float64 tolerance, so the sweeps alone."""
    from lockstep.harness.attention_check import AttnSizes, check_attention
    from lockstep.harness.check import Pool, invariance
    from lockstep.harness.masked_attention_check import MaskedSizes, check_masked_attention
    from lockstep.harness.specs import SPECS, Sizes

    sizes = Sizes(hidden=40, out_features=24, heads=2, head_dim=8, ffn=24, vocab=300, lm_hidden=16, embed_vocab=20,
                  pool=12)
    failed = []
    for name, spec in SPECS.items():
        sweeps, _ = invariance(Pool(spec, torch.float64, sizes, seed=0, grad=spec.differentiable), "native", 0)
        failed += [f"{name}: {s.sweep}: {s.detail}" for s in sweeps if not s.passed]
    for report in (check_attention(torch.float64, "native", with_accuracy=False,
                                   sizes=AttnSizes(lens=(20, 1, 70), head_dim=16, chunks=(7,))),
                   check_masked_attention(torch.float64, "native", with_accuracy=False,
                                          sizes=MaskedSizes(lens=(20, 1, 70), head_dim=16))):
        failed += [f"{report.op}: {s.sweep}: {s.detail}" for s in report.sweeps if not s.passed]
        assert len(report.sweeps) > 5
    assert not failed, failed


def test_a_products_dtype_follows_its_first_operand():
    """A float64 operand beside a 16- or 32-bit first one is rounded to fp32, as torch_weight_grad
    rounds it; a float64 first operand makes a float64 product, the other widened exactly."""
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 40, generator=gen), torch.randn(40, 5, generator=gen, dtype=torch.float64)
    g, x = torch.randn(6, 3, generator=gen), torch.randn(6, 7, generator=gen, dtype=torch.float64)
    with native_kernels():
        assert torch.equal(fixed_order.matmul_rows(a, b), fixed_order.matmul_rows(a, b.float()))
        assert torch.equal(fixed_order.weight_grad(g, x), fixed_order.weight_grad(g, x.float()))
        wide = fixed_order.matmul_rows(b.t(), a.t())
        assert wide.dtype == torch.float64 and torch.equal(wide, fixed_order.matmul_rows(b.t(), a.t().double()))
        wide = fixed_order.weight_grad(x, g)
        assert wide.dtype == torch.float64 and torch.equal(wide, fixed_order.weight_grad(x, g.double()))


@pytest.mark.parametrize("k", [1029, 4133], ids=lambda k: f"K={k}")
def test_float64_gemm_bits_across_instruction_sets_threads_and_rows(k, isa):
    """The float64 products linear and weight gradients make (through fixed_order, which takes
    float64 to the kernels), batched too: the same bits in every instruction set and on 1, 2 and 3
    threads, a row's and a column's bits those of the whole call, and each the kernel's documented
    dot (test_float64_gemm_order_is_the_documented_one) of its rows. On QEMU's Haswell, MKL's float64
    GEMM gave other bits on 1 and 2 threads and for the first 8 rows alone (docs/adr/0027)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, k, generator=gen, dtype=torch.float64)
    b = torch.randn(301, k, generator=gen, dtype=torch.float64)
    bias = torch.randn(301, generator=gen, dtype=torch.float64)
    g = torch.randn(37, 40, generator=gen, dtype=torch.float64)
    batched = torch.randn(3, 9, k, generator=gen, dtype=torch.float64)
    outs = []
    for name in build.supported_isas():
        isa(name)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with native_kernels():
                outs.append((fixed_order.matmul_rows(a, b.t(), bias), fixed_order.weight_grad(g, a),
                             fixed_order.matmul_rows(batched, batched.transpose(-1, -2))))
    for other in outs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(outs[0], other))
    y = outs[0][0]
    with native_kernels():
        assert torch.equal(fixed_order.matmul_rows(a[5:6], b.t(), bias), y[5:6])
        assert torch.equal(fixed_order.matmul_rows(a[:8], b.t(), bias), y[:8])
        assert torch.equal(fixed_order.matmul_rows(a, b[7:9].t(), bias[7:9]), y[:, 7:9])
    assert y.dtype == torch.float64 and torch.equal(y, gemm.gemm_nt(a, b, bias, out_dtype=torch.float64))
    assert torch.equal(outs[0][1], gemm.gemm_nt(g.t().contiguous(), a.t().contiguous(), out_dtype=torch.float64))
    assert torch.equal(outs[0][2], torch.stack([gemm.gemm_nt(t, t, out_dtype=torch.float64) for t in batched]))


@pytest.mark.parametrize("dtype, k", [(torch.float32, 2048 * 2 + 37), (torch.bfloat16, 4096 * 2 + 75)], ids=str)
def test_a_long_k_in_blocks_keeps_the_documented_order(dtype, k):
    """Rows of 8 KB or more run in blocks of K, each tile's lanes carried from block to block: the
    order's bits, restated in Python (fp32: lane k % 16 adds element k; bf16: lane j of chunk c adds
    element 32 c + 2 j + 1, then 32 c + 2 j), then the fold."""
    gen = torch.Generator().manual_seed(9)
    a, b = torch.randn(5, k, generator=gen).to(dtype), torch.randn(6, k, generator=gen).to(dtype)
    got = gemm.gemm_nt(a, b)
    width = 16 if dtype == torch.float32 else 32
    padded = -(-k // width) * width
    af = torch.nn.functional.pad(a.float(), (0, padded - k))[:, None, :].expand(5, 6, padded)
    bf = torch.nn.functional.pad(b.float(), (0, padded - k))[None, :, :].expand(5, 6, padded)
    lanes = torch.zeros(5, 6, 16)
    for c in range(0, padded, width):
        if dtype == torch.float32:
            lanes = _fma32(af[..., c:c + 16], bf[..., c:c + 16], lanes)
        else:
            for odd in (1, 0):
                idx = torch.arange(16) * 2 + c + odd
                lanes = _fma32(af[..., idx], bf[..., idx], lanes)
    t = lanes[..., :8] + lanes[..., 8:]
    u = t[..., :4] + t[..., 4:]
    v = u[..., :2] + u[..., 2:]
    assert torch.equal(got, v[..., 0] + v[..., 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_long_k_gives_the_same_bits_in_items_of_every_size(dtype):
    """A long K's outputs run in items of 128, 64 or 32 outputs a side, by the thread count and the
    shape (their lanes on the heap above 32): every size gives the bits of five-row products (32)."""
    gen = torch.Generator().manual_seed(10)
    k = 8192 // (2 if dtype == torch.bfloat16 else 4) * 2 + 75
    a, b = torch.randn(300, k, generator=gen).to(dtype), torch.randn(290, k, generator=gen).to(dtype)
    with num_threads(2):                                      # five rows on 2 threads: 32 a side
        pieces = torch.cat([gemm.gemm_nt(a[i:i + 5], b) for i in range(0, 300, 5)])
    for threads in (1, 2, 3):
        with num_threads(threads):
            assert torch.equal(gemm.gemm_nt(a, b), pieces), threads


@pytest.mark.parametrize("dtype, bits", [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)], ids=str)
def test_the_blocked_transpose_moves_every_bit_pattern(dtype, bits):
    """The kernels' transpose (vector tiles inside, element loops at the edges) on every bit pattern,
    NaN payloads and signalling NaNs included, at sizes around its 8- and 64-element blocks."""
    gen = torch.Generator().manual_seed(12)
    top = 2 ** (8 * torch.tensor([], dtype=bits).element_size() - 1)
    for rows, cols in ((2, 9), (7, 8), (8, 8), (9, 63), (64, 64), (65, 130), (200, 17)):
        raw = torch.randint(-top, top, (3, cols + 5, rows + 3), generator=gen, dtype=torch.int64).to(bits)
        for source in (raw[0, :cols, :rows], raw[:, 2:cols + 2, 1:rows + 1]):  # padded rows; a batch of them
            x = source.view(dtype).transpose(-1, -2)         # [(B,) rows, cols], unit stride along rows
            got = gemm._rows_contiguous(x)
            assert got.stride(-1) == 1 and torch.equal(got.view(bits), source.transpose(-1, -2)), (rows, cols)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_operands_in_another_layout_are_copied_element_for_element(dtype):
    """gemm_nt's copies into row-contiguous form (the kernels' blocked transpose for transposed
    matrices, torch's copy for anything else): the values, moved, whatever the shape and strides."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 131, 67, generator=gen).to(dtype)
    views = [x[0].t(), x.transpose(1, 2), x[:, ::2].transpose(1, 2), x[1].t()[5:70], x.permute(2, 0, 1)[:, 1],
             x[0, :1].t(), torch.randn(700, 500, generator=gen).to(dtype).t()]
    for v in views:
        got = gemm._rows_contiguous(v)
        assert got.stride(-1) == 1 or got.shape[-1] <= 1
        assert torch.equal(got, v), tuple(v.shape)


def test_a_large_operand_copy_reuses_the_last_calls_buffer_until_the_next_call():
    """A transposed copy of 64 MB or more takes the buffer the previous GEMM call's largest copy
    left, whatever that held, and gives the bits of a product on a fresh copy; a call without one
    lets the buffer go."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 1024, generator=gen).bfloat16()
    w1, w2 = (torch.randn(1024, 32_768, generator=gen).bfloat16() for _ in range(2))   # [K, N]: 64 MB
    y1 = gemm.matmul_rows(x, w1)                                # copies w1.T into a new buffer
    (kept,) = gemm._kept
    y2 = gemm.matmul_rows(x, w2)                                # into the same buffer
    assert gemm._kept[0].data_ptr() == kept.data_ptr()
    for y, w in ((y1, w1), (y2, w2)):
        assert torch.equal(y, gemm.gemm_nt(x, w.t().contiguous(), out_dtype=torch.bfloat16))
    assert gemm._kept == []                                     # that call made no copy
    gemm.matmul_rows(x, w1[:, :8])
    assert gemm._kept == []


def test_weight_grad_of_rows_appended_with_zero_gradient_is_unchanged():
    gen = torch.Generator().manual_seed(2)
    g, x = torch.randn(50, 33, generator=gen), torch.randn(50, 70, generator=gen)
    pad_g, pad_x = torch.cat([g, torch.zeros(13, 33)]), torch.cat([x, torch.randn(13, 70, generator=gen)])
    assert torch.equal(gemm.weight_grad(g, x), gemm.weight_grad(pad_g, pad_x))
    torch.testing.assert_close(gemm.weight_grad(g, x).double(), g.double().t() @ x.double(), atol=1e-4, rtol=1e-5)


def test_exp_and_log_bits_across_instruction_sets_and_their_accuracy(isa):
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(50_001, generator=gen) * 30, torch.linspace(-110, 95, 20_003),
                   torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 88.72, 88.73, -103.9, -104.1, float("inf"),
                                 float("-inf"), float("nan")])])
    pos = torch.cat([torch.rand(50_001, generator=gen) * 1e3, torch.tensor([1e-45, 1e-40, 1.17549435e-38, 1.0,
                                                                            2.0 ** 0.5, 3e38])])
    results = []
    for name in build.supported_isas():
        isa(name)
        results.append((unary.exp(x), unary.log(pos), unary.log(x)))
    for other in results[1:]:
        for u, v in zip(results[0], other):
            assert torch.equal(u.view(torch.int32), v.view(torch.int32))
    e, lg, lgx = results[0]
    ref_e, ref_l = torch.exp(x.double()), torch.log(pos.double())
    normal = (ref_e > 1.2e-38) & (ref_e < 3.4e38)  # fp32's normal range: 2 ulp = 2.4e-7 relative
    assert ((e.double() - ref_e).abs() <= 2.4e-7 * ref_e.abs())[normal].all()
    assert torch.equal(torch.isinf(e), torch.isinf(ref_e.float())) and torch.isnan(e[-1])
    assert ((lg.double() - ref_l).abs() <= 2.4e-7 * ref_l.abs().clamp_min(1.0)).all()
    assert lgx[x < 0].isnan().all() and (lgx[x == 0] == float("-inf")).all() and lgx[-3] == float("inf")


def test_sqrt_is_the_ieee_root_in_every_instruction_set(monkeypatch):
    """The native sqrt (AdamW's denominator) is the correctly rounded root, bit for bit, in every
    path this CPU runs, tails and the special values included; bf16 in is widened exactly; `out`
    takes it in place, strided, as x itself or as a shifted view of x."""
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.exp(torch.rand(100_003, generator=gen, dtype=torch.float64) * 180 - 100).float(),
                   torch.tensor([0.0, -0.0, 1e-45, 1e-40, 3.4e38, 1.0, 2.0, float("inf"), -1.0, float("nan")])])

    def ieee(t: torch.Tensor) -> torch.Tensor:
        """float64's correctly rounded root, rounded to fp32: the fp32 root (53 >= 2 x 24 + 2 bits)."""
        return torch.tensor([math.sqrt(v) if v >= 0 else float("nan") for v in t.tolist()]).float()

    want, xb = ieee(x), x[:1000].bfloat16()
    if platform.machine() == "x86_64":                              # CI's: scalar, AVX2 and more
        assert {"scalar", "avx2"} <= set(build.supported_isas()), build.supported_isas()
    for name in build.supported_isas():
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", name)
        got = unary.sqrt(x)
        assert torch.equal(got.view(torch.int32)[:-2], want.view(torch.int32)[:-2]), name
        assert got[-2:].isnan().all() and str(got[-9].item()) == "-0.0", name
        assert torch.equal(unary.sqrt(xb), ieee(xb.float()).bfloat16()), name
    got = unary.sqrt(x)
    out = torch.empty_like(x)
    assert unary.sqrt(x, out=out) is out and torch.equal(out.view(torch.int32), got.view(torch.int32))
    strided = torch.empty(x.numel(), 2)[:, 0]                       # AdamW's buffer for a transposed weight
    assert unary.sqrt(x, out=strided) is strided and torch.equal(strided.view(torch.int32), got.view(torch.int32))
    same = x.clone()
    assert unary.sqrt(same, out=same) is same and torch.equal(same.view(torch.int32), got.view(torch.int32))
    shifted = torch.cat([x, torch.zeros(1)])
    unary.sqrt(shifted[:-1], out=shifted[1:])
    assert torch.equal(shifted[1:].view(torch.int32), got.view(torch.int32))
    with pytest.raises(ValueError, match=r"out: expected a float32 CPU tensor of shape \(5,\), got "
                                         r"torch.bfloat16 on cpu of shape \(5,\)"):
        unary.sqrt(torch.ones(5), out=torch.empty(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out: expected a float64 CPU tensor of shape \(5,\), got "
                                         r"torch.float32 on cpu of shape \(5,\)"):
        unary.sqrt(torch.ones(5, dtype=torch.float64), out=torch.empty(5))


# 1 / i!, correctly rounded: the Taylor coefficients of kernels.c's float64 exp.
_EXP_TAYLOR = [float(Fraction(1, math.factorial(i))) for i in range(14)]


def _exp64(x: float) -> float:
    """kernels.c's float64 exp restated in Python's float64 arithmetic (each operation IEEE-rounded
    once): n = x log2 e rounded to nearest even; r = x - n ln2 in two parts; Taylor to r^13 by
    Horner's rule; times 2^n in two exact-exponent steps."""
    if x != x:
        return x
    if x > float.fromhex("0x1.62e42fefa39efp+9"):
        return math.inf
    if x < -float.fromhex("0x1.74910d52d3051p+9"):
        return 0.0
    n = (x * 1.4426950408889634 + 6755399441055744.0) - 6755399441055744.0     # + 1.5 x 2^52: rint
    r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10
    p = _EXP_TAYLOR[13]
    for c in reversed(_EXP_TAYLOR[:13]):
        p = p * r + c
    n1 = int(n / 2)
    return (p * 2.0 ** n1) * 2.0 ** (int(n) - n1)


def test_float64_exp_log_and_sqrt_are_the_documented_arithmetic_in_every_instruction_set(monkeypatch):
    """float64 exp and log are one C code on every path (docs/adr/0027): exp is `_exp64` bit for
    bit; log is exact_math.log_float64 (the sampler's) bit for bit; sqrt is the IEEE root. Against
    exact values (50-digit decimals) exp is within 1 ulp and log within 2; the special values and
    the overflow and underflow edges are IEEE's; the bits are the same in every instruction set
    and on 3 threads."""
    gen = torch.Generator().manual_seed(7)
    top, bottom = float.fromhex("0x1.62e42fefa39efp+9"), -float.fromhex("0x1.74910d52d3051p+9")
    edges = [top, math.nextafter(top, math.inf), bottom, math.nextafter(bottom, -math.inf), -708.4, 0.0, -0.0,
             math.inf, -math.inf, math.nan]
    x = torch.cat([torch.rand(40_000, generator=gen, dtype=torch.float64) * 1500 - 750,
                   torch.randn(40_000, generator=gen, dtype=torch.float64), torch.tensor(edges, dtype=torch.float64)])
    pos = torch.cat([torch.exp(torch.rand(40_000, generator=gen, dtype=torch.float64) * 1400 - 700),
                     torch.tensor([5e-324, 2.2250738585072014e-308, 1.0 + 2 ** -52, 1.0 - 2 ** -53, 2 ** 0.5,
                                   1.7976931348623157e308], dtype=torch.float64)])
    results = []
    for name in build.supported_isas():
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", name)
        results.append((unary.exp(x), unary.log(pos), unary.log(x), unary.sqrt(x)))
    with num_threads(3):
        results.append((unary.exp(x), unary.log(pos), unary.log(x), unary.sqrt(x)))
    for other in results[1:]:
        for u, v in zip(results[0], other):
            assert torch.equal(u.view(torch.int64), v.view(torch.int64))
    e, lg, lgx, root = results[0]
    assert e.dtype == lg.dtype == lgx.dtype == root.dtype == torch.float64
    want = torch.tensor([_exp64(v) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(e.view(torch.int64), want.view(torch.int64))
    assert torch.equal(lg, exact_math.log_float64(pos))
    real = x >= 0
    assert torch.equal(root[real], torch.tensor([math.sqrt(v) for v in x[real].tolist()], dtype=torch.float64))
    assert root[x < 0].isnan().all() and root[-1].isnan() and math.copysign(1.0, root[-4].item()) == -1.0

    context = decimal.Context(prec=50)

    def exact(f, v: float) -> float:
        return float(f(decimal.Decimal(v)))

    def ulps(got: float, exact_value: float) -> float:
        return abs(got - exact_value) / math.ulp(exact_value)

    for v, got in zip(x[::97].tolist(), e[::97].tolist()):
        if 2.3e-308 < got < 1.7e308:
            assert ulps(got, exact(context.exp, v)) <= 1, v
    for v, got in zip(pos[::97].tolist() + pos[-6:].tolist(), lg[::97].tolist() + lg[-6:].tolist()):
        assert ulps(got, exact(context.ln, v)) <= 2, v
    tail = e[-len(edges):].tolist()
    assert tail[0] < math.inf and tail[1] == math.inf                  # the overflow edge
    assert tail[2] == exact(context.exp, bottom) > 0 and tail[3] == 0.0    # the underflow edge
    assert tail[4] == exact(context.exp, -708.4)                       # a subnormal result
    assert tail[5:9] == [1.0, 1.0, math.inf, 0.0] and math.isnan(tail[9])
    tail = lgx[-len(edges):].tolist()
    assert tail[5:8] == [-math.inf, -math.inf, math.inf] and math.isnan(tail[8]) and math.isnan(tail[9])
    assert lgx[x < 0].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_exp_log_and_roots_on_the_kernels_are_differentiable_as_torchs(dtype):
    """fixed_order's exp, log, sqrt and rsqrt on the native kernels, called where autograd records
    (softcap's tanh, Transformer.logits under the mode), give torch's formulas' gradients on their
    own values; where autograd does not record, the kernels' result carries no graph."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.rand(1000, generator=gen, dtype=torch.float64) * 4 + 0.1).to(dtype).requires_grad_(True)
    g = torch.randn(1000, generator=gen, dtype=torch.float64).to(dtype)
    with native_kernels():
        for fn, dydx in ((fixed_order.exp, lambda y: g * y), (fixed_order.log, lambda y: g / x.detach()),
                         (fixed_order.sqrt, lambda y: g / (2 * y))):
            y = fn(x)
            assert torch.equal(y.detach(), getattr(unary, fn.__name__)(x.detach()))
            (dx,) = torch.autograd.grad(y, x, g)
            assert torch.equal(dx, dydx(y.detach())), fn.__name__
        y = fixed_order.rsqrt(x)
        (dx,) = torch.autograd.grad(y, x, g)
        root = unary.sqrt(x.detach())
        r = 1 / root
        assert torch.equal(y.detach(), r) and torch.equal(dx, (-g * (r * r)) / (2 * root))
        assert type(fixed_order.exp(x).grad_fn).__name__ == "_OnKernelsBackward"
        assert fixed_order.exp(x.detach()).grad_fn is None
        with pytest.raises(RuntimeError, match="out: sqrt into out= does not support automatic differentiation"):
            fixed_order.sqrt(x, out=torch.empty_like(x.detach()))


def test_softcapped_logits_on_the_kernels_keep_their_gradient():
    """Transformer.logits softcaps through fixed_order.exp, which runs on the native kernels under
    them (the mode enters them): its gradient reaches every weight, finite and nonzero, and the same
    bits twice (before ADR 0027 the backward raised: the capped logits carried no graph). The
    formulas' bits are test_exp_log_and_roots_on_the_kernels_are_differentiable_as_torchs'."""
    model = Transformer.from_config(ModelConfig.tiny("gemma3_text", vocab_size=300, final_logit_softcapping=30.0),
                                    seed=0)
    ids, cu = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(0)), torch.tensor([0, 12])
    grads = []
    for _ in range(2):
        model.zero_grad()
        with native_kernels():
            model.logits(ids, cu).square().sum().backward()
        assert all(p.grad is not None and p.grad.isfinite().all() and p.grad.abs().max() > 0
                   for p in model.parameters())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ops_under_native_and_portable_agree_within_the_contract(dtype):
    """They need not agree bitwise (docs/contract.md); both are held to the float64 reference by
    the op tests. Here: native is the CPU default, and a linear layer on it differs from portable's
    at most by accumulation rounding."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 256, generator=gen).to(dtype), (torch.randn(64, 256, generator=gen) / 16).to(dtype)
    assert registry.cpu_backend() == "native"
    native = ops.linear(x, w)
    with registry.use_backend("portable"):
        portable = ops.linear(x, w)
    torch.testing.assert_close(native.float(), portable.float(), atol=2e-2 if dtype != torch.float32 else 1e-5,
                               rtol=1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_rounds_to_bf16_in_the_kernel_as_torch_rounds_its_fp32_result(dtype):
    """out_dtype=bf16 gives the bits of the fp32 result's .to(torch.bfloat16), bias included: ties
    (to even), overflow to Inf, subnormals, and NaN (torch writes 0xffff)."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(37, 70, generator=gen), torch.randn(29, 70, generator=gen)
    a[0, :] = 0.0
    a[0, 0], b[:, 0] = 1.0, torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -3.4e38, 1e-40, 2.0**-130, float("inf"),
                                          float("-inf"), float("nan")] + [1 + 2**-9] * 20)
    a[3, 5] = float("nan")
    a, b = a.to(dtype), b.to(dtype)
    bias = torch.randn(29, generator=gen)
    for with_bias in (None, bias):
        want = gemm.gemm_nt(a, b, with_bias).to(torch.bfloat16)
        got = gemm.gemm_nt(a, b, with_bias, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    row0 = gemm.gemm_nt(a[:1].float(), b[:9].float(), out_dtype=torch.bfloat16)
    if dtype == torch.float32:   # the edge values themselves survive only in fp32 operands
        assert row0.view(torch.int16)[0, :8].tolist() == [16256, 16258, 32640, -128, 1, 8, 32640, -128]
        assert row0.view(torch.int16)[0, 8].item() == -1


def test_gemm_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"a, b: expected \[\(B,\) M, K\] and \[\(B,\) N, K\], got \(3, 4\) and \(2, 5\)"):
        gemm.gemm_nt(torch.ones(3, 4), torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"out: expected a torch.float32 tensor of shape \(3, 2\) with unit column "
                                         r"stride, got torch.float64"):
        gemm.gemm_nt(torch.ones(3, 4), torch.ones(2, 4), out=torch.empty(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="out: expected a torch.bfloat16 tensor of shape"):
        gemm.gemm_nt(torch.ones(3, 4), torch.ones(2, 4), out=torch.empty(3, 2), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out_dtype: expected torch.float32 or torch.bfloat16 \(torch.float64 for "
                                         r"float64 operands\), got torch.float16"):
        gemm.gemm_nt(torch.ones(3, 4), torch.ones(2, 4), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out: expected a contiguous torch.float32 tensor of shape"):
        gemm.weight_grad(torch.ones(3, 4), torch.ones(3, 5), out=torch.empty(5, 4))
    with pytest.raises(ValueError, match="out: expected a contiguous torch.float64 tensor of shape"):
        gemm.weight_grad(torch.ones(3, 4, dtype=torch.float64), torch.ones(3, 5), out=torch.empty(4, 5))
    with pytest.raises(ValueError, match="out_dtype, parts: float64 operands give a float64 product in one part, got "
                                         "torch.float32 in 1"):
        gemm.gemm_nt(torch.ones(3, 4, dtype=torch.float64), torch.ones(2, 4))
    with pytest.raises(ValueError, match="got torch.float64 in 2"):
        gemm.gemm_nt(torch.ones(3, 4, dtype=torch.float64), torch.ones(2, 4), out_dtype=torch.float64, parts=2)


def test_a_forced_instruction_set_must_be_known_and_runnable(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match=r"LOCKSTEP_CPU_ISA: expected one of \['scalar', 'avx2', 'avx512', 'avx512bf16'\], got 'sse9'"):
        build.isa()
    missing = [name for name in build.ISAS if name not in build.supported_isas()]
    if missing:
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", missing[-1])
        with pytest.raises(ValueError, match="this CPU does not run"):
            build.isa()


def _fallback_lines(tmp_path: Path, emulator: tuple[str, ...] = (), environ: dict[str, str] | None = None
                    ) -> list[str]:
    """The lines a process without a working compiler (CC=/bin/false, nothing on PATH) prints about
    the native backend, on 2 threads, run by `emulator` (a QEMU command line) or directly, in
    `environ` (default: this process's environment)."""
    code = ("import torch, lockstep\nfrom lockstep import ops, registry\ntorch.set_num_threads(2)\n"
            "x, w = torch.randn(3, 8), torch.randn(4, 8)\ny = ops.linear(x, w)\n"
            "with registry.use_backend('portable'):\n    assert torch.equal(y, ops.linear(x, w))\n"
            "print(registry.cpu_backend())\n")
    env = {**(os.environ if environ is None else environ), "CC": "/bin/false", "PATH": str(tmp_path),
           "LOCKSTEP_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([*emulator, sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "portable"
    return [line for line in proc.stderr.splitlines() if "native CPU backend" in line]


FALLBACK_LINE = ("lockstep: the native CPU backend is not in use (false could not compile kernels.c: (no message)); "
                 "running the portable backend, whose bits follow this machine's BLAS")


def test_without_a_working_compiler_the_portable_backend_runs_and_one_line_says_why(tmp_path):
    """The line also says what the portable backend loses where this machine's GEMM breaks its
    premises (none on the machines CI runs on; QEMU's Haswell does, in the test above)."""
    with num_threads(2):
        caveat = registry.portable_caveat()
    assert _fallback_lines(tmp_path) == [FALLBACK_LINE + (f"; {caveat}" if caveat else "")]


def _stand_in_compiler(tmp_path: Path, library: Path | None, builds: str = "", processes: int = 1,
                       fails_with: str = "kernels.c:212:5: error: unknown type name '__m512'") -> str:
    """A CC for the tests of how a build is found, cached, locked, repaired and cut down, not of
    what the compiler makes of kernels.c: it answers --version and names its assembler as the real
    compiler (both are part of the cache key), and a build copies `library`, a build of kernels.c
    that the real compiler made once, to the -o file, where compiling would take about 27 s of a
    core (None: the real compiler compiles). With `processes` > 1 a build first waits (up to 120 s)
    until that many processes have asked for the version, which each does just before it takes the
    build's lock, and then 2 s more: the others find it compiling, however far apart they started.
    With `builds`, it stands in for a compiler too old for some of kernels.c's intrinsics (named
    old-cc): it builds only when the define `builds` is among its arguments, and otherwise fails as
    GCC 4.8 fails on AVX-512 code, its error after the line that names the function. Returns CC's
    value, quoted as a shell would need it."""
    real = shlex.join(build.compiler())
    script = tmp_path / ("old-cc" if builds else "copying-cc")
    asked = shlex.quote(str(tmp_path / "asked-for-the-version"))
    refuse = f"""case " $* " in
  *" {builds} "*) ;;
  *) echo "kernels.c: In function 'tile_z':" >&2; echo {shlex.quote(fails_with)} >&2; exit 1 ;;
esac
""" if builds else ""
    wait = f"""i=0
while [ "$(sort -u {asked} 2>/dev/null | wc -l)" -lt {processes} ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done
sleep 2
""" if processes > 1 else ""
    make = f"""out=
prev=
for arg in "$@"; do case $prev in -o) out=$arg ;; esac; prev=$arg; done
{wait}exec cp {shlex.quote(str(library))} "$out"
""" if library is not None else f'exec {real} "$@"\n'
    script.write_text(f"""#!/bin/sh
case " $* " in
  *" --version "*) echo $PPID >> {asked}; exec {real} "$@" ;;
  *" -print-prog-name="*) exec {real} "$@" ;;
esac
{refuse}{make}""")
    script.chmod(0o755)
    return shlex.quote(str(script))


@pytest.fixture(scope="module")
def reduced_build(tmp_path_factory):
    """kernels.c as the real compiler builds it with a define (-DLS_NO_DPBF16, -DLS_NO_X86), compiled
    on first use and shared by the tests that need that build."""
    folder, made = tmp_path_factory.mktemp("reduced-builds"), {}

    def get(define: str) -> Path:
        if define not in made:
            so = folder / f"kernels{define}.so"
            done = subprocess.run(build.compile_command(build.compiler(), [define], str(so)), capture_output=True,
                                  text=True)
            assert done.returncode == 0, done.stderr
            made[define] = so
        return made[define]
    return get


@pytest.fixture(scope="module")
def this_build() -> Path:
    """The file of the kernel library this process runs (the real compiler's whole build)."""
    return Path(build.library()._name)


@pytest.mark.parametrize("define", ["-DLS_NO_DPBF16", "-DLS_NO_X86"])
def test_a_compiler_that_cannot_build_every_path_still_gives_the_native_bits(define, tmp_path, reduced_build):
    """A compiler that fails on part of kernels.c (too old for AVX-512's or AVX512_BF16's
    intrinsics) must not send the machine to the portable backend, whose bits differ: the kernels
    are built without the paths it cannot compile, one line says which and why, and ops give the
    whole build's bits (here and in test_a_build_with_fewer_paths_gives_the_same_bits). The next
    process loads that build without a word, `lockstep check` names what was left out, and forcing
    a left-out instruction set says that the build lacks it."""
    code = ("import json, torch\nfrom lockstep import ops, registry\nfrom lockstep.backends.native import build\n"
            "torch.manual_seed(0)\nx, w = torch.randn(5, 300), torch.randn(7, 300)\n"
            "y = [ops.linear(x.to(d), w.to(d)).float().flatten().tolist() for d in (torch.float32, torch.bfloat16)]\n"
            "print(json.dumps([registry.cpu_backend(), build.supported_isas(), build.unbuilt_isas(), y]))\n")
    env = {**os.environ, "CC": _stand_in_compiler(tmp_path, reduced_build(define), define),
           "LOCKSTEP_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("LOCKSTEP_CPU_ISA", None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "environ", env)
        cached = build.cached_library(build.compiler())
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    backend, supported, unbuilt, got = json.loads(first.stdout)
    left_out = {"-DLS_NO_DPBF16": ("the VDPBF16PS path", ["avx512bf16"]),
                "-DLS_NO_X86": ("the x86 vector paths", ["avx2", "avx512", "avx512bf16"])}[define]
    cpu = [name for name, flags in ISA_FLAGS.items() if flags <= cpu_flags()]
    assert backend == "native"
    assert unbuilt == [name for name in cpu if name in left_out[1]]
    assert supported == [name for name in build.supported_isas() if name not in left_out[1]]
    assert first.stderr.splitlines() == [
        f"lockstep: compiling the native CPU kernels into {tmp_path / 'cache'} (kept for this kernel source and "
        "compiler)",
        f"lockstep: old-cc could not compile all of kernels.c (kernels.c:212:5: error: unknown type name '__m512'); "
        f"built it without {left_out[0]}, with the same bits, but a CPU that runs those instructions leaves them "
        f"unused (CC picks another compiler; delete {cached} to compile again)"], first.stderr
    torch.manual_seed(0)
    x, w = torch.randn(5, 300), torch.randn(7, 300)
    assert got == [ops.linear(x.to(d), w.to(d)).float().flatten().tolist() for d in (torch.float32, torch.bfloat16)]
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert (again.returncode, again.stderr, json.loads(again.stdout)[:3]) == (0, "", [backend, supported, unbuilt])
    if unbuilt:
        check = subprocess.run([sys.executable, "-m", "lockstep", "check", "linear", "--dtype", "fp32", "--no-large"],
                               env=env, capture_output=True, text=True, timeout=300)
        assert check.returncode == 0, check.stderr
        assert check.stdout.splitlines()[0].startswith(
            f"lockstep check: backend=native isa={supported[-1]} (the compiler left out {', '.join(unbuilt)}) "
            "threads="), check.stdout
        forced = subprocess.run([sys.executable, "-c", code], env={**env, "LOCKSTEP_CPU_ISA": unbuilt[0]},
                                capture_output=True, text=True, timeout=300)
        assert forced.returncode != 0
        assert (f"LOCKSTEP_CPU_ISA: this CPU runs {unbuilt[0]!r}, but the compiler built the kernels without its "
                f"path; they run {supported}") in forced.stderr, forced.stderr


@pytest.mark.parametrize("fails_with", ["gcc: fatal error: Killed signal terminated program cc1",
                                        "kernels.c:2500:1: internal compiler error: Segmentation fault",
                                        "kernels.c:1:1: fatal error: error writing to /tmp/cc.s: No space left on device"])
def test_a_compile_that_fails_for_the_machines_sake_is_not_cached_with_fewer_paths(fails_with, tmp_path, monkeypatch):
    """A compile killed for memory, out of disk or crashed inside the compiler says nothing about
    which paths the compiler can build: nothing is cached (a build without paths would stay), and
    the error names what happened."""
    monkeypatch.setenv("CC", _stand_in_compiler(tmp_path, None, "-DLS_NO_X86", fails_with=fails_with))
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(build.NativeUnavailable) as e:
        build._compile(build.compiler())
    assert str(e.value) == f"old-cc could not compile kernels.c: {fails_with}"
    assert list((tmp_path / "cache").glob("native-*.so")) == []


def test_lockstep_check_names_the_instruction_set_and_says_why_native_cannot_run(tmp_path):
    """`lockstep check` prints the native instruction set in its first line; asked for the native
    backend where it cannot be built, it exits 2 with one line that says why, not a traceback, and
    the portable backend still runs."""
    argv = [sys.executable, "-m", "lockstep", "check", "linear", "--dtype", "fp32", "--no-large"]
    ok = subprocess.run([*argv, "--backend", "native"], env={**os.environ, "LOCKSTEP_CPU_ISA": "scalar"},
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0].startswith("lockstep check: backend=native isa=scalar threads="), ok.stdout
    env = {**os.environ, "CC": "/bin/false", "LOCKSTEP_CACHE_DIR": str(tmp_path / "cache")}
    bad = subprocess.run([*argv, "--backend", "native"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.splitlines()[-1:] == ["lockstep check: backend: 'native' cannot be loaded: false could not "
                                            "compile kernels.c: (no message)"], bad.stderr
    assert "Traceback" not in bad.stderr
    portable = subprocess.run([*argv, "--backend", "portable"], env=env, capture_output=True, text=True, timeout=300)
    assert portable.returncode == 0, portable.stderr
    assert portable.stdout.splitlines()[0].startswith("lockstep check: backend=portable threads="), portable.stdout


def test_lockstep_check_fails_where_the_kernels_are_not_the_recorded_bits(tmp_path, monkeypatch, capsys):
    """`lockstep check` on the native backend compares the kernels' bits on every instruction set
    this CPU runs with recorded_bits.json, whatever ops it checks: one line when they agree (here
    with a recording of this machine's own bits, so that this tests the command alone); where one
    kernel group differs, the line names it on every instruction set, the exit status is 1 whatever
    the op rows say, and the JSON and HTML reports carry it. A recording it cannot read is named."""
    from lockstep import cli

    argv = ["check", "linear", "--dtype", "fp32", "--no-large"]
    recorded = {**bits.recorded(), "kernels": bits.digests(build.library(), build.isa(), 1),
                "native_backend": backend_bits.digests(), "torch": [backend_bits.release(torch.__version__)]}
    monkeypatch.setattr(bits, "RECORDED", tmp_path / "recorded_bits.json")
    bits.RECORDED.write_text(json.dumps(recorded))
    assert cli.main([*argv, "--html", str(tmp_path / "same.html")]) == 0
    on = recorded["recorded_on"]
    line = capsys.readouterr().out.splitlines()[1]
    assert line == (f"native bits: the recorded ones on {', '.join(build.supported_isas())} (recorded on "
                    f"{on['machine']}, {on['isa']})"), line
    assert "<p class=pass>Native bits: the recorded ones on " in (tmp_path / "same.html").read_text()

    recorded["kernels"]["rope"] = "0" * 64
    bits.RECORDED.write_text(json.dumps(recorded))
    assert cli.main([*argv, "--json", str(tmp_path / "c.json"), "--html", str(tmp_path / "c.html")]) == 1
    out = capsys.readouterr().out
    line = out.splitlines()[1]
    where = "; ".join(f"{isa}: rope" for isa in build.supported_isas())
    assert line.startswith(f"native bits: FAIL: On this machine ({bench.machine()}) the kernels gave other bits than "
                           f"those recorded on {on['machine']} ({on['isa']}), in {where}. If you changed"), line
    assert "1 passed, 0 failed" in out and "the native bits are not the recorded ones" in out, out
    report = json.loads((tmp_path / "c.json").read_text())["native_bits"]
    assert report["differ"] == {isa: ["rope"] for isa in build.supported_isas()}
    assert f"in {where} (docs/adr/0026)" in (tmp_path / "c.html").read_text()

    for text, says in (("{", "cannot read the recorded bits"),
                       ('{"kernels": {}}', "it lacks native_backend, recorded_on, torch"),
                       (json.dumps({**recorded, "torch": "2.13.0+cpu"}), "torch is not a list of releases")):
        bits.RECORDED.write_text(text)
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert str(bits.RECORDED) in err and says in err and "reinstall lockstep" in err, err


def test_lockstep_check_compares_the_whole_native_backend_under_the_torch_releases_recorded(tmp_path, monkeypatch,
                                                                                           capsys):
    """After the kernels' line, `lockstep check` compares the whole native backend (backend_bits:
    ops, attention, the model's arithmetic, training) with the recording: it passes when they agree;
    where a section differs under a torch release the recording lists, it fails (exit 1) and names
    the section; where torch's generators draw other numbers (another release or C library), or under
    a release it does not list, it says so and does not fail, since the inputs differ or may. The
    reports carry it."""
    from lockstep import cli

    argv = ["check", "linear", "--dtype", "fp32", "--no-large"]
    this = backend_bits.release(torch.__version__)
    recorded = {**bits.recorded(), "kernels": bits.digests(build.library(), build.isa(), 1),
                "native_backend": backend_bits.digests(), "torch": [this]}
    monkeypatch.setattr(bits, "RECORDED", tmp_path / "recorded_bits.json")
    bits.RECORDED.write_text(json.dumps(recorded))
    assert cli.main([*argv, "--html", str(tmp_path / "same.html")]) == 0
    n = len(recorded["native_backend"])
    line = capsys.readouterr().out.splitlines()[2]
    assert line == (f"native backend bits: the recorded ones in all {n} sections (ops forward and backward, "
                    f"attention, the model's arithmetic, training) under torch {this}"), line
    assert f"<p class=pass>Native backend bits: the recorded ones in all {n} sections" in (
        tmp_path / "same.html").read_text()

    recorded["native_backend"]["training"] = "0" * 64
    bits.RECORDED.write_text(json.dumps(recorded))
    assert cli.main([*argv, "--json", str(tmp_path / "c.json"), "--html", str(tmp_path / "c.html")]) == 1
    out = capsys.readouterr().out
    line = out.splitlines()[2]
    on = recorded["recorded_on"]
    assert line.startswith(f"native backend bits: FAIL: On this machine ({bench.machine()}, torch {this}) the native "
                           f"backend gave other bits than those recorded on {on['machine']} ({on['isa']}), in "
                           f"{build.isa_name()}: training. If you changed"), line
    assert out.splitlines()[1].startswith("native bits: the recorded ones on "), out
    assert "1 passed, 0 failed" in out and "the native bits are not the recorded ones" in out, out
    report = json.loads((tmp_path / "c.json").read_text())["native_bits"]
    assert report["backend"] == {"torch": this, "listed": True, "sections": n, "differ": ["training"], "counted": True}
    assert report["failed"] is True
    assert (f"<p class=fail>Native backend bits: not the recorded ones (recorded on {on['machine']}, {on['isa']}), in "
            f"training, under torch {this} (docs/adr/0026).</p>") in (tmp_path / "c.html").read_text()

    recorded["native_backend"][backend_bits.GENERATORS] = "0" * 64
    bits.RECORDED.write_text(json.dumps(recorded))
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2] == (f"native backend bits: other than the recorded ones in 2 of {n} sections, and "
                                   f"torch's generators draw other numbers here than on {on['machine']} (torch {this} "
                                   "or this C library), so the inputs differ and this is not counted as a failure"), out
    recorded["native_backend"][backend_bits.GENERATORS] = backend_bits.digests()[backend_bits.GENERATORS]

    recorded["torch"] = ["1.0.0"]
    bits.RECORDED.write_text(json.dumps(recorded))
    assert cli.main([*argv, "--html", str(tmp_path / "u.html")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2] == (f"native backend bits: other than the recorded ones in training under torch {this}, "
                                   "which the recording does not list (torch 1.0.0): its generators may draw other "
                                   "inputs, so this is not counted as a failure"), out
    assert "the native bits are not the recorded ones" not in out, out
    assert "where the inputs may differ from the recording's (not counted as a failure)" in (
        tmp_path / "u.html").read_text()


def test_a_cache_folder_that_cannot_be_written_still_gives_the_native_backend(tmp_path, this_build):
    """A cache folder that cannot be created (here a file stands in its way; a read-only home is the
    usual case) must not send the process to the portable backend, whose bits differ: the kernels
    are compiled into a temporary folder, one line says so, and the folder goes at exit."""
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"
    code = ("from lockstep import registry\nfrom lockstep.backends.native import build\n"
            "print(registry.cpu_backend())\nprint(build.library()._name)\n")
    env = {**os.environ, "LOCKSTEP_CACHE_DIR": str(cache), "CC": _stand_in_compiler(tmp_path, this_build)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    backend, loaded = proc.stdout.split()
    assert backend == "native"
    scratch = Path(loaded).parent
    assert proc.stderr.splitlines() == [
        f"lockstep: the native kernels' cache folder {cache} cannot be written (Not a directory); they are compiled "
        f"for this process alone, in {scratch} (LOCKSTEP_CACHE_DIR names another folder)",
        f"lockstep: compiling the native CPU kernels into {scratch} (for this process alone)"
    ], proc.stderr
    assert not scratch.exists()


def test_processes_starting_together_compile_the_kernels_once(tmp_path, this_build):
    """Two processes on a fresh cache folder (torchrun's ranks, say): one compiles, the other waits
    for its file under a lock, and both run the native backend. (The build waits for the second
    process to reach the lock, so that it finds the first one compiling.)"""
    code = "from lockstep import registry\nprint(registry.cpu_backend())\n"
    cache = tmp_path / "cache"
    env = {**os.environ, "LOCKSTEP_CACHE_DIR": str(cache),
           "CC": _stand_in_compiler(tmp_path, this_build, processes=2)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.strip() for out, _ in outs] == ["native", "native"], outs
    lines = sorted(line for _, err in outs for line in err.splitlines())
    assert lines == [f"lockstep: compiling the native CPU kernels into {cache} (kept for this kernel source and "
                     "compiler)",
                     f"lockstep: waiting for another process to compile the native CPU kernels into {cache}"], outs
    assert len(list(cache.glob("native-*.so"))) == 1


def test_a_cached_library_that_does_not_load_is_compiled_again(tmp_path, this_build):
    """A cached file cut short (a crash mid-write, a full disk) must not send every later process to
    the portable backend: the one that finds it says so, compiles over it, and runs native; the
    next process loads the repaired file without a word."""
    code = "from lockstep import registry\nprint(registry.cpu_backend())\n"
    cache = tmp_path / "cache"
    env = {**os.environ, "LOCKSTEP_CACHE_DIR": str(cache), "CC": _stand_in_compiler(tmp_path, this_build)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCKSTEP_CACHE_DIR", str(cache))
        mp.setenv("CC", env["CC"])
        cached = build.cached_library(build.compiler())
    cache.mkdir()
    cached.write_bytes(b"cut short")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and first.stdout.strip() == "native", first.stderr
    lines = first.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"lockstep: the cached native kernels {cached} could not be "
                                                   "loaded ("), first.stderr
    assert lines[0].endswith("); compiling them again") and "compiling the native CPU kernels into" in lines[1]
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert (again.returncode, again.stdout.strip(), again.stderr) == (0, "native", "")


def test_without_file_locks_the_kernels_still_compile_readable_to_every_user(tmp_path, monkeypatch, this_build):
    """A file system that refuses locks (some network ones) only costs the lock: the kernels still
    compile, and the file is readable and executable by every user of a shared cache (mkstemp
    alone would leave it to its owner)."""
    import ctypes
    import errno
    import fcntl
    import stat

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", _stand_in_compiler(tmp_path, this_build))
    path = build._compile(build.compiler())
    assert path.parent == tmp_path / "cache" and stat.S_IMODE(path.stat().st_mode) == 0o755
    assert build.declare(ctypes.CDLL(str(path))).ls_abi_version() == build.ABI_VERSION


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma, emulated in float64: the product of two fp32 values is exact there."""
    return (c.double() + a.double() * b.double()).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_order_is_the_documented_one(dtype):
    """kernels.c's attention forward, restated in Python for one sequence of 70 keys (two 64-key
    blocks) with a window that cuts into the first: the GEMM's scores times the scale, the block
    max, the file's exp, the block sum as 16 lane sums folded, the output as one FMA chain per
    dimension over the visible keys, rescaled by alpha, divided by the sum at the end. A query alone
    (decode) gives the same bits as inside the prefill."""
    from lockstep.backends.native.attention import attention_forward

    gen = torch.Generator().manual_seed(2)
    n, d, window, scale = 70, 20, 67, 0.3
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype) for h in (2, 1, 1))
    out, row_max, row_sum = attention_forward(q, k, v, [0, n], [n], [0], None, scale, True, window)
    qf, kf, vf = q.float(), k.float(), v.float()
    for t in (0, 40, 63, 64, 69):
        one, _, _ = attention_forward(q[t:t + 1], k[:t + 1], v[:t + 1], [0, 1], [t + 1], [0], None, scale, True,
                                      window)
        assert torch.equal(one[0], out[t]), t
        for h in range(2):
            m, l, o = _attention_row(qf[t, h], kf[:, 0], vf[:, 0], [j for j in range(t + 1) if j > t - window], 0,
                                     scale)
            assert torch.equal(row_max[t, h], m) and torch.equal(row_sum[t, h], l), (t, h)
            assert torch.equal(out[t, h], o), (t, h)


def _attention_row(q, k, v, keys, anchor, scale):
    """kernels.c's arithmetic for one query row q [D] over the visible `keys` (ascending indices
    into k, v [L, D], fp32: 16-bit operands widened first, as the kernel's scores are the fp32
    GEMM's dot of the widened values), in 64-key blocks from `anchor`: (row max, row sum, output)."""
    d = q.shape[0]
    m, l, acc = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(d)
    for k0 in range(anchor, k.shape[0], 64):
        block = [j for j in keys if k0 <= j < k0 + 64]
        if not block:
            continue
        s = gemm.gemm_nt(q[None], k[block])[0] * scale
        new = torch.maximum(m, s.max())
        shift = torch.where(new == float("-inf"), torch.tensor(0.0), new)
        alpha = unary.exp((m - shift)[None])[0]
        p = torch.zeros(64)
        p[[j - k0 for j in block]] = unary.exp(s - shift)
        lanes = ((p[0:16] + p[16:32]) + p[32:48]) + p[48:64]
        tt = lanes[:8] + lanes[8:]
        u = tt[:4] + tt[4:]
        w = u[:2] + u[2:]
        l = l * alpha + (w[0] + w[1])
        pv = torch.zeros(d)
        for j in block:
            pv = _fma32(p[j - k0].expand(d), v[j], pv)
        acc = acc * alpha + pv
        m = new
    return m, l, acc / (l if l != 0 else torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_masked_attention_order_is_the_documented_one(dtype):
    """The same arithmetic under an explicit mask with holes (masked_attention, the mode's attention):
    only the keys the mask shows enter a row, its blocks start at the first of them (2 and 7 here:
    left padding), k and v are read in place from [B, Hkv, Lk, D], and a row that sees no key gets
    zeros and a logsumexp of -inf. Each row equals itself computed alone (one query, decode)."""
    gen = torch.Generator().manual_seed(3)
    b, lq, lk, d, scale = 2, 5, 140, 24, 0.2
    q = torch.randn(b, 4, lq, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, 2, lk, d, generator=gen).to(dtype) for _ in range(2))
    visible = torch.rand(b, lq, lk, generator=gen) < 0.7
    visible[0, :, :2] = False
    visible[1, :, :7] = False
    visible[0, :, 2] = visible[1, :, 7] = True
    visible[1, 3] = False
    out, lse = ops.masked_attention(q, k, v, visible, scale)
    qf, kf, vf = q.float(), k.float(), v.float()
    for i in range(b):
        for t in range(lq):
            keys = torch.nonzero(visible[i, t])[:, 0].tolist()
            one, one_lse = ops.masked_attention(q[i:i + 1, :, t:t + 1], k[i:i + 1], v[i:i + 1], visible[i:i + 1, t:t + 1],
                                                scale)
            assert torch.equal(one[0, :, 0], out[i, :, t]) and torch.equal(one_lse[0, :, 0], lse[i, :, t]), (i, t)
            for h in range(4):
                m, l, o = _attention_row(qf[i, h, t], kf[i, h // 2], vf[i, h // 2], keys, keys[0] if keys else 0,
                                         scale)
                assert torch.equal(out[i, h, t].float(), o.to(dtype).float()), (i, t, h)
                assert torch.equal(lse[i, h, t], m + unary.log(l[None])[0]), (i, t, h)
    assert (out[1, :, 3] == 0).all() and (lse[1, :, 3] == float("-inf")).all()


def test_attention_never_reads_a_key_into_a_row_that_cannot_see_it():
    """A NaN key at position 60 reaches the queries at 60 and after, not the ones before it, though
    they share its 64-key block; and a NaN value reaches no query that cannot see it (contract,
    section 7; the portable op lets it through 0 * NaN)."""
    from lockstep.backends.native.attention import attention_forward

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(64, 2, 16, generator=gen) for _ in range(3))
    k[60, 0, 3] = float("nan")
    v[62, 1, 5] = float("nan")
    out, _, _ = attention_forward(q, k, v, [0, 64], [64], [0], None, 0.25, True, None)
    assert torch.isfinite(out[:60]).all() and torch.isfinite(out[60:62, 1]).all()
    assert torch.isnan(out[60:, 0]).all() and torch.isnan(out[62:, 1, 5]).all()


def _fold16(lanes: torch.Tensor) -> torch.Tensor:
    t = lanes[:8] + lanes[8:]
    u = t[:4] + t[4:]
    w = u[:2] + u[2:]
    return w[0] + w[1]


def _attention_backward(qf, kf, vf, gf, row_max, row_sum, keys_of, anchor_of, scale):
    """kernels.c's attention backward for the rows (t, h) of one sequence and KV head, restated:
    qf, gf [Lq, G, D] and kf, vf [Lk, D] fp32 (16-bit operands widened first), row_max, row_sum
    [Lq, G] the forward's, keys_of[t] the keys token t sees (ascending), anchor_of[t] its first
    block's start. Returns (dq [Lq, G, D], dk, dv [Lk, D]), fp32."""
    lq, g_size, d = qf.shape
    rows = [(t, h) for t in range(lq) for h in range(g_size)]          # row i = t * G + h
    dq, dk, dv = torch.zeros(lq, g_size, d), torch.zeros(kf.shape), torch.zeros(kf.shape)
    p, ds = {}, {}
    for t, h in rows:
        keys = keys_of[t]
        if not keys:
            continue
        s = gemm.gemm_nt(qf[t, h][None], kf[keys])[0] * scale
        pt = unary.exp(s - row_max[t, h]) / row_sum[t, h]
        dp = gemm.gemm_nt(gf[t, h][None], vf[keys])[0]
        starts = range(anchor_of[t], keys[-1] + 1, 64)
        delta = torch.tensor(0.0)
        for k0 in starts:
            w = torch.zeros(64)
            block = [i for i, j in enumerate(keys) if k0 <= j < k0 + 64]
            if block:
                w[[keys[i] - k0 for i in block]] = pt[block] * dp[block]
                delta = delta + _fold16(((w[0:16] + w[16:32]) + w[32:48]) + w[48:64])
        dst = pt * (dp - delta)
        acc = torch.zeros(d)
        for k0 in starts:
            part = torch.zeros(d)
            for i, j in enumerate(keys):
                if k0 <= j < k0 + 64:
                    part = _fma32(dst[i].expand(d), kf[j], part)
            acc = acc + part
        dq[t, h] = acc * scale
        p.update({(t, h, j): pt[i] for i, j in enumerate(keys)})
        ds.update({(t, h, j): dst[i] for i, j in enumerate(keys)})
    for j in range(kf.shape[0]):
        seeing = [(t, h) for t, h in rows if (t, h, j) in p]
        acc_k, acc_v = torch.zeros(d), torch.zeros(d)
        for r0 in range(0, len(seeing), 64):
            group_k, group_v = torch.zeros(d), torch.zeros(d)
            for r1 in range(r0, min(r0 + 64, len(seeing)), 8):
                run_k, run_v = torch.zeros(d), torch.zeros(d)
                for t, h in seeing[r1:min(r1 + 8, r0 + 64)]:
                    run_k = _fma32(ds[t, h, j].expand(d), qf[t, h], run_k)
                    run_v = _fma32(p[t, h, j].expand(d), gf[t, h], run_v)
                group_k, group_v = group_k + run_k, group_v + run_v
            acc_k, acc_v = acc_k + group_k, acc_v + group_v
        dk[j], dv[j] = acc_k * scale, acc_v
    return dq, dk, dv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("isa_name", ["scalar", "avx2", "avx512"])
def test_attention_backward_order_is_the_documented_one(dtype, isa_name, isa):
    """kernels.c's attention backward, restated in Python for one sequence of 70 tokens (two 64-key
    blocks; 140 rows of a KV head, up to 134 of which see one key) with a window that cuts into the
    first: p from the forward's scores, max and sum; dp by the GEMM's dot; delta as the blocks'
    folded lane sums of p dp; dq as one FMA chain per key block, the blocks added in order; dk and
    dv over the rows that see the key as one FMA chain per run of 8, the runs added in groups of 64,
    the groups added in order."""
    from lockstep.backends.native.attention import attention_backward, attention_forward

    isa(isa_name)
    gen = torch.Generator().manual_seed(5)
    n, d, window, scale = 70, 72, 67, 0.3      # d: four chunks of 16 and a part of one
    q, go = (torch.randn(n, 2, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(n, 1, d, generator=gen).to(dtype) for _ in range(2))
    _, row_max, row_sum = attention_forward(q, k, v, [0, n], [n], [0], None, scale, True, window)
    dq, dk, dv = attention_backward(q, k, v, go, row_max, row_sum, [0, n], [n], [0], scale, True, window)
    keys_of = [[j for j in range(t + 1) if j > t - window] for t in range(n)]
    want = _attention_backward(q.float(), k.float()[:, 0], v.float()[:, 0], go.float(), row_max, row_sum, keys_of,
                               [0] * n, scale)
    assert torch.equal(dq, want[0]) and torch.equal(dk[:, 0], want[1]) and torch.equal(dv[:, 0], want[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_masked_attention_backward_order_is_the_documented_one(dtype):
    """The same arithmetic under an explicit mask with holes: each row's blocks start at the first
    key it sees (2 and 7 here: left padding), a row that sees nothing adds nothing, and rows that
    see nothing (padding) are not counted in a key's groups of 64 rows."""
    gen = torch.Generator().manual_seed(7)
    b, lq, lk, d, scale = 2, 40, 140, 24, 0.2
    q, go = (torch.randn(b, 4, lq, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, 2, lk, d, generator=gen).to(dtype) for _ in range(2))
    visible = torch.rand(b, lq, lk, generator=gen) < 0.7
    visible[0, :, :2] = False
    visible[1, :, :7] = False
    visible[0, :, 2] = visible[1, :, 7] = True
    visible[1, 3] = visible[1, 10] = False
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = ops.masked_attention(q, k, v, visible, scale)
    out.backward(go)
    with torch.no_grad():
        _, _, (row_max, row_sum) = masked_attention.forward(q, k, v, visible, scale)
    for i in range(b):
        keys_of = [torch.nonzero(visible[i, t])[:, 0].tolist() for t in range(lq)]
        for hk in range(2):
            heads = slice(2 * hk, 2 * hk + 2)
            want = _attention_backward(q.detach()[i, heads].float().transpose(0, 1), k.detach()[i, hk].float(),
                                       v.detach()[i, hk].float(), go[i, heads].float().transpose(0, 1),
                                       row_max[i, :, heads], row_sum[i, :, heads], keys_of,
                                       [keys[0] if keys else 0 for keys in keys_of], scale)
            assert torch.equal(q.grad[i, heads].transpose(0, 1).float(), want[0].to(dtype).float()), (i, hk)
            assert torch.equal(k.grad[i, hk].float(), want[1].to(dtype).float()), (i, hk)
            assert torch.equal(v.grad[i, hk].float(), want[2].to(dtype).float()), (i, hk)
    assert (q.grad[1, :, 3] == 0).all()


def test_attention_backward_keeps_a_nan_query_in_its_own_row_and_keys():
    """A NaN query (token 30, head 1) reaches the dk and dv of the keys it sees and nothing else: the
    other rows' dq and the keys after it stay finite."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, go = (torch.randn(64, h, 16, generator=gen) for h in (2, 1, 1, 2))
    q[30, 1, 4] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, 64], dtype=torch.int32)
    ops.attention(q, k, v, cu, cu, 0.25, True, None).backward(go)
    others = torch.ones(64, 2, dtype=torch.bool)
    others[30, 1] = False
    assert torch.isfinite(q.grad[others]).all() and torch.isnan(q.grad[30, 1]).all()
    assert torch.isnan(k.grad[:31]).any() and torch.isfinite(k.grad[31:]).all() and torch.isfinite(v.grad[31:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_forward_is_the_portable_arithmetic(dtype, isa):
    """The C forward performs the portable forward's operations in the portable order, so both
    backends give the same bits, forward and backward, on every instruction set, at row lengths
    above, below and between the sum's 512 lanes; with NaN and Inf rows staying in their rows."""
    gen = torch.Generator().manual_seed(5)
    for name, hidden in itertools.product(build.supported_isas(), (1024, 576, 513, 80, 7)):
        isa(name)
        x = (torch.randn(37, hidden, generator=gen) * 3).to(dtype)
        x[3, 1] = float("nan")
        x[5, 0] = float("inf")
        w = torch.randn(hidden, generator=gen).to(dtype)
        grads = {}
        for backend in ("native", "portable"):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            with registry.use_backend(backend):
                y = ops.rms_norm(xx, ww, eps=1e-6, offset=1.0)
            y.backward(torch.ones_like(y))
            grads[backend] = (y.detach(), xx.grad, ww.grad)
        for a, b in zip(grads["native"], grads["portable"]):
            assert torch.equal(_bits(a), _bits(b)), (name, hidden)
        assert torch.isfinite(grads["native"][0][[0, 1, 2, 4] + list(range(6, 37))]).all()


def _rms_norm_unit_partials(backend: str, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor,
                            offsets: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """rms_norm's d x and the weight's unit partials ([heads, H] per unit for heads x tokens rows),
    with the units' token offsets `offsets`, on `backend`."""
    from lockstep.numerics import grad_tree
    from lockstep.numerics.fixed_order import TreeSum

    weight = torch.nn.Parameter(w.clone())
    xx = x.clone().requires_grad_()
    trees = grad_tree.UnitTrees([("norm", weight)])
    leaves = []
    tree_add = TreeSum.add

    def add(tree, start, size, value, donated=False):
        leaves.append(value.clone())   # before the tree adds into it
        tree_add(tree, start, size, value, donated)

    with (trees.active(), grad_tree.unit_rows(offsets, 0), registry.use_backend(backend),
          pytest.MonkeyPatch.context() as patch):
        patch.setattr(TreeSum, "add", add)
        y = ops.rms_norm(xx, weight, eps=1e-6, offset=0.5)
        y.backward(gy)
    assert weight.grad is None, "inside a unit tree the partials go to the tree"
    return xx.grad, leaves


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_backward_in_c_is_the_portable_arithmetic_unit_by_unit(dtype, isa):
    """Inside a unit tree the C backward hands the tree one partial per unit, each with the portable
    column sum's bits: units of 0, 1, 130 and 300 tokens (past the sum's 128-row blocks), one and
    three rows per token (a q/k norm's heads), row lengths 72 and 1024 (strips of 64 columns and a
    partial one), 1 to 3 threads, every instruction set; NaN in one unit stays in that unit's
    partial and its own row of d x."""
    gen = torch.Generator().manual_seed(9)
    offsets = [0, 130, 130, 131, 431]   # unit 1 is empty
    for name, threads, heads, hidden in itertools.product(build.supported_isas(), (1, 2, 3), (1, 3), (72, 1024)):
        if heads == 3 and hidden == 1024 or (name, threads) != ("scalar", 1) and hidden == 72 and heads == 1:
            continue
        isa(name)
        rows = offsets[-1] * heads
        x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
        x[140 * heads, 5] = float("nan")   # token 140: unit 3
        w = torch.randn(hidden, generator=gen).to(dtype)
        gy = torch.randn(rows, hidden, generator=gen).to(dtype)
        with num_threads(threads):
            native = _rms_norm_unit_partials("native", x, w, gy, offsets)
            portable = _rms_norm_unit_partials("portable", x, w, gy, offsets)
        assert torch.equal(_bits(native[0]), _bits(portable[0])), (name, threads, heads, hidden)
        assert len(native[1]) == len(portable[1]) == len(offsets) - 1
        for a, b in zip(native[1], portable[1]):
            assert a.shape == ((heads, hidden) if heads > 1 else (hidden,))
            assert torch.equal(_bits(a), _bits(b)), (name, threads, heads, hidden)
        assert torch.isnan(native[1][3]).any() and not torch.isnan(torch.stack(native[1][:3])).any()
        finite_rows = torch.ones(rows, dtype=torch.bool)
        finite_rows[140 * heads] = False
        assert torch.isfinite(native[0][finite_rows]).all()


def _fused_and_composed(op, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor, **kwargs) -> list:
    """op's output and input gradients on the native backend (rope and silu_mul: one C pass each in
    fp32 and bf16) and as the portable composition on the native exp (what the native backend ran
    before them): [(fused, composed), ...]."""
    from lockstep.backends.native.cpu import native_kernels

    results = []
    for backend in ("native", "portable"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with registry.use_backend(backend), native_kernels():
            y = op(*leaves, **kwargs)
        y.backward(grad)
        results.append([y.detach()] + [t.grad for t in leaves])
    return list(zip(*results))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_and_silu_mul_in_c_are_the_compositions_bit_for_bit(dtype, isa):
    """The fused passes perform the portable operations element for element, forward and backward,
    on every instruction set and 1 to 3 threads: silu_mul at sizes around the 512-element blocks and
    the one-thread cut, rope in both styles at head sizes 2 to 256, with NaN, Inf and -Inf staying
    in their elements. NaN is compared as NaN (`_bits`): the composition's final rounding to bf16
    gives a NaN other bits in torch's vector loop than in its tail. fp16 takes the composition."""
    gen = torch.Generator().manual_seed(8)
    for name in build.supported_isas():
        isa(name)
        for threads in (1, 2, 3):
            with num_threads(threads):
                for rows, width in ((3, 7), (37, 1000), (64, 1024), (1, 513)):
                    gate = (torch.randn(rows, width, generator=gen) * 6).to(dtype)
                    up = torch.randn(rows, width, generator=gen).to(dtype)
                    gate.view(-1)[[5, 1, 2]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
                    up.view(-1)[3] = float("inf")
                    dy = torch.randn(rows, width, generator=gen).to(dtype)
                    for fused, composed in _fused_and_composed(ops.silu_mul, (gate, up), dy):
                        assert torch.equal(_bits(fused), _bits(composed)), (name, threads, rows, width)
                    assert torch.isfinite(ops.silu_mul(gate, up).view(-1)[6:]).all()
                for tokens, heads, head_dim in ((5, 3, 8), (70, 4, 128), (7, 2, 2), (9, 2, 256)):
                    x = (torch.randn(tokens, heads, head_dim, generator=gen) * 3).to(dtype)
                    x[1, 0, 1], x[2, 1, 0] = float("nan"), float("inf")
                    positions = torch.randint(0, 40_000, (tokens,), generator=gen)
                    dy = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
                    for style in ("neox", "gptj"):
                        for fused, composed in _fused_and_composed(ops.rope, (x,), dy, positions=positions,
                                                                   theta=1e6, style=style):
                            assert torch.equal(_bits(fused), _bits(composed)), (name, threads, head_dim, style)
        if dtype == torch.float16:
            break  # the composition itself, on every instruction set in the digest
    # Empty tensors (whose data pointers may be NULL) pass through, forward and backward.
    gate = torch.empty(0, 8, dtype=dtype, requires_grad=True)
    ops.silu_mul(gate, gate.detach().clone().requires_grad_()).sum().backward()
    x = torch.empty(3, 0, 8, dtype=dtype, requires_grad=True)
    ops.rope(x, torch.arange(3)).sum().backward()
    assert gate.grad.shape == (0, 8) and x.grad.shape == (3, 0, 8)
    assert ops.rope(torch.empty(3, 2, 0, dtype=dtype), torch.arange(3)).shape == (3, 2, 0)
    if dtype == torch.float16:
        return
    # The C pass reads one angle per token: fewer positions than tokens are refused by name.
    with pytest.raises(ValueError, match="positions: expected one per token"):
        registry.resolve("rope", torch.device("cpu"))(torch.ones(4, 2, 8, dtype=dtype), torch.arange(1), 1e4, "neox",
                                                       None)
    # rope's gradient stays differentiable under create_graph, with the portable op's bits.
    x0 = torch.randn(3, 2, 8, generator=gen).to(dtype)
    second = []
    for backend in ("native", "portable"):
        x = x0.clone().requires_grad_()
        with registry.use_backend(backend):
            y = ops.rope(x, torch.arange(3), 1e4, "neox")
            (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
            (gg,) = torch.autograd.grad((g * g).sum(), x)
        second.append((g.detach(), gg))
    assert all(torch.equal(a, b) for a, b in zip(*second))


@pytest.mark.parametrize("define", ["LS_NO_X86", "LS_NO_DPBF16"])
def test_a_build_with_fewer_paths_gives_the_same_bits(define, monkeypatch, reduced_build):
    """kernels.c built without its x86 paths (-DLS_NO_X86), as it builds on ARM, or without the
    VDPBF16PS path (-DLS_NO_DPBF16), as a compiler older than AVX512_BF16 builds it: every op of
    the digest, forward and backward, in fp32, bf16 and fp16, on the widest path that build has,
    gives the bits of the full build's scalar path, which the tests above tie to the others. (Run
    on x86: an ARM machine itself has not been tried.)"""
    import ctypes

    so = reduced_build(f"-D{define}")
    monkeypatch.setenv("LOCKSTEP_CPU_ISA", "scalar")
    want = backend_bits.digests()
    other = build.declare(ctypes.CDLL(str(so)))
    full = [name in build.supported_isas() for name in build.ISAS]
    expected = [True, False, False, False] if define == "LS_NO_X86" else full[:3] + [False]
    assert [bool(other.ls_cpu_supports(code)) for code in build.ISAS.values()] == expected
    widest = [name for name, ok in zip(build.ISAS, expected) if ok][-1]
    modules = [m for name, m in sys.modules.items()
               if name.startswith("lockstep.backends.native.") and getattr(m, "library", None) is build.library]
    assert {m.__name__.rsplit(".", 1)[1] for m in modules} >= {"attention", "gemm", "rms_norm", "rope", "rows",
                                                               "silu", "unary"}
    for module in modules:
        monkeypatch.setattr(module, "library", lambda: other)
    monkeypatch.setenv("LOCKSTEP_CPU_ISA", widest)
    assert backend_bits.digests() == want
    missing = [name for name, ok in zip(build.ISAS, expected) if not ok and name in build.supported_isas()]
    if missing:  # the ops did run on `other`: it refuses a path it was built without
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", missing[0])
        with pytest.raises(RuntimeError, match="ls_gemm_nt refused"):
            gemm.gemm_nt(torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(2, 3, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def unfused():
    """The native kernel set without its fused row reductions, split products and SiLU:
    fixed_order's PyTorch compositions on the native GEMMs, exp and log."""
    from lockstep.backends.native.cpu import KERNELS
    from lockstep.numerics.fixed_order import register_cpu_kernels

    register_cpu_kernels(KERNELS._replace(name="native-unfused", row_sum=None, log_softmax=None,
                                          log_softmax_backward=None, lse_fold=None, logit_grad=None,
                                          split_matmul_rows=None, silu=None, silu_backward=None,
                                          weight_grad_node=None))
    return "native-unfused"


def test_row_sum_and_log_softmax_in_c_are_the_compositions_bit_for_bit(unfused):
    """row_sum, log_softmax and its backward in C against fixed_order's compositions, at lengths
    below, at and past the sum's 512 lanes and a 152k vocabulary, with NaN, Inf, -inf rows and -0.0
    (whose padded sum is +0), rows whose largest value is -0.0 or +0.0 first, on 1 and 2 threads."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(6)
    for length in (1, 2, 3, 63, 64, 100, 511, 512, 513, 1025, 4097, 151936):
        x = torch.randn(9, length, generator=gen) * 4
        g = torch.randn(9, length, generator=gen)
        if length > 3:
            x[1, 2] = float("nan")
            x[2, 1] = float("inf")
            x[3] = float("-inf")
            x[4] = -0.0
            x[5, ::2] = -0.0
            g[6, 3] = float("nan")
            x[7], x[8] = -x[7].abs(), -x[8].abs()          # largest value zero: the first zero's sign counts
            x[7, 2], x[7, 3], x[8, 2], x[8, 3] = -0.0, 0.0, 0.0, -0.0
        for threads in (1, 2):
            with num_threads(threads):
                with fo.cpu_kernels(unfused):
                    want = (fo.row_sum(x), fo.log_softmax_rows(x), fo.log_softmax_rows_backward(g, x.clamp_max(0)))
                with fo.cpu_kernels(KERNELS.name):
                    got = (fo.row_sum(x), fo.log_softmax_rows(x), fo.log_softmax_rows_backward(g, x.clamp_max(0)))
            for name, w, o in zip(("row_sum", "log_softmax", "backward"), want, got):
                assert torch.equal(w.view(torch.int32), o.view(torch.int32)), (name, length, threads)
    with fo.cpu_kernels(KERNELS.name):
        assert fo.row_sum(torch.ones(4, 0)).tolist() == [0.0] * 4
        assert torch.equal(fo.row_sum(torch.ones(2, 3, 700)), torch.full((2, 3), 700.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_unit_trees_weight_gradient_in_one_call_is_the_composition_bit_for_bit(unfused, dtype, isa, monkeypatch):
    """fixed_order.weight_grad_node (a piece of units' canonical tree node of per-unit weight
    gradients) in one kernel call against tree_node_into over separate GEMMs and tensor adds, on
    every instruction set and 1 to 3 threads: 2 to 16 units, empty units, units of 4,100 rows (the
    long-K blocks of a separate GEMM; the kernel's limit on a unit's length lifted for them),
    magnitudes six decades apart, NaN and Inf (compared as NaN). Then a linear and the LM head
    inside a unit tree, whose pieces take it: the same trees."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.numerics import grad_tree
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(12)
    long = torch.ones(4101, 1).to(dtype)
    assert gemm.weight_grad_node(long, long, [0, 4100, 4101], torch.empty(1, 1)) is None, "long units decline"
    monkeypatch.setattr(gemm, "_NODE_UNIT_BYTES", 1 << 40)
    cases = (([0, 5, 5, 37, 40], 70, 33), (list(range(0, 1025, 64)), 300, 64),
             ([0, 0, 0, 1, 9, 9, 20, 21, 300], 40, 130), ([0, 4100, 4101], 8, 12))
    for name, threads, (bounds, n, k) in itertools.product(build.supported_isas(), (1, 2, 3), cases):
        isa(name)
        rows = bounds[-1]
        g = (torch.randn(rows, n, generator=gen) * 10.0 ** torch.randint(-3, 3, (rows, 1), generator=gen)).to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        g[rows // 2, 3], x[rows - 1, 2] = float("nan"), float("inf")
        got = []
        for kernels in (KERNELS.name, unfused):
            with num_threads(threads), fo.cpu_kernels(kernels):
                got.append(fo.weight_grad_node(g, x, bounds, torch.empty(n, k), []))
        assert torch.equal(_bits(got[0]), _bits(got[1])), (name, threads, bounds[:4])
    # Inside a unit tree: four units of unequal length in one micro-batch, so each tree gets one
    # piece of four units, its node made in one call on the native set.
    offsets = [0, 3, 10, 10, 17]
    x = torch.randn(17, 24, generator=gen).to(dtype)
    w, head = (torch.randn(40, 24, generator=gen) / 4).to(dtype), (torch.randn(300, 40, generator=gen) / 4).to(dtype)
    targets = torch.randint(0, 300, (17,), generator=gen)
    totals = []
    for kernels in (KERNELS.name, unfused):
        params = [("head", torch.nn.Parameter(head.clone())), ("w", torch.nn.Parameter(w.clone()))]
        trees = grad_tree.UnitTrees(params)
        with trees.active(), grad_tree.unit_rows(offsets, 0), registry.use_backend("portable"), fo.cpu_kernels(kernels):
            ops.selected_logprobs(ops.linear(x, params[1][1]), params[0][1], targets, 1.0).sum().backward()
        totals.append([trees.trees[key].total() for key in trees.keys()])
    assert len(totals[0]) == 2 and all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*totals))
    with pytest.raises(ValueError, match="out: expected a contiguous torch.float32 tensor of shape"):
        gemm.weight_grad_node(g, x, bounds, torch.empty(k, n))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_split_product_in_one_call_is_the_composition_bit_for_bit(unfused, dtype, isa):
    """A tensor-parallel layer's split reduction (linear's split_k forward, split_n input gradient)
    in one GEMM call against split_sum over separate GEMMs and tensor adds, forward and backward, on
    every instruction set and 1 to 3 threads, with row and column tails, 2 to 16 parts, NaN and Inf
    (NaN compared as NaN). fp16, and slices of 8 KB or more, take the composition."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(9)
    cases = ((1, 100, 3072, 4, 2), (5, 6, 64, 2, 2), (9, 36, 512, 8, 4), (32, 40, 2048, 16, 8), (3, 8, 16384, 4, 2))
    for name in build.supported_isas():
        isa(name)
        for threads, (rows, n, k, split_k, split_n) in itertools.product((1, 2, 3), cases):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            w = (torch.randn(n, k, generator=gen) / 8).to(dtype)
            x[0, 3], w[1, 5] = float("nan"), float("inf")
            dy = torch.randn(rows, n, generator=gen).to(dtype)
            dy[-1, 1] = float("nan")
            results = []
            for kernels in (KERNELS.name, unfused):
                xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
                # The portable op on a chosen kernel set (the native op would select the native set).
                with num_threads(threads), registry.use_backend("portable"), fo.cpu_kernels(kernels):
                    y = ops.linear(xx, ww, split_k=split_k, split_n=split_n)
                    y.backward(dy)
                results.append((y.detach(), xx.grad, ww.grad))
            for fused, composed in zip(*results):
                assert torch.equal(_bits(fused), _bits(composed)), (name, threads, rows, n, k)
            if dtype != torch.float16 and k <= 4096:
                assert gemm.split_parts_supported(x, w.t(), split_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_alone_in_c_is_the_composition_bit_for_bit(unfused, dtype, isa):
    """fixed_order.silu and silu_backward (the batch-invariant mode's aten::silu) in one C pass
    against their PyTorch compositions, on every instruction set and 1 to 3 threads, at sizes around
    the 512-element blocks, with Inf, -Inf and NaN (compared as NaN); fp16 takes the composition."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(10)
    for name in build.supported_isas():
        isa(name)
        for threads, shape in itertools.product((1, 2, 3), ((3, 7), (2, 37, 1000), (1, 513))):
            x = (torch.randn(*shape, generator=gen) * 6).to(dtype)
            x.view(-1)[[1, 2, 5]] = torch.tensor([float("inf"), float("-inf"), float("nan")]).to(dtype)
            dy = torch.randn(*shape, generator=gen).to(dtype)
            results = []
            for kernels in (KERNELS.name, unfused):
                with num_threads(threads), fo.cpu_kernels(kernels):
                    results.append((fo.silu(x), fo.silu_backward(dy, x)))
            for fused, composed in zip(*results):
                assert fused.shape == composed.shape and torch.equal(_bits(fused), _bits(composed)), (name, shape)


def test_a_split_product_names_the_parts_it_cannot_take():
    a, b = torch.ones(2, 12), torch.ones(3, 12)
    for parts in (3, 24):
        with pytest.raises(RuntimeError, match=f"in {parts} parts"):
            gemm.gemm_nt(a, b, parts=parts)
    with pytest.raises(RuntimeError, match="in 2 parts"):
        gemm.gemm_nt(a, b, bias=torch.ones(3), parts=2)
    assert not gemm.split_parts_supported(a.half(), b.half().t(), 2)
    from lockstep.numerics import fixed_order as fo

    with pytest.raises(ValueError, match=r"a, b: expected \[M, K\] and \[K, N\]"):
        fo.split_matmul_rows(torch.ones(2, 3, 8), torch.ones(8, 4), 2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits, every NaN as one: torch.maximum's NaN has other bits in the vector body of its loop
    than in the scalar tail, so the composition's NaN payload follows a row's position."""
    t = torch.where(t.isnan(), torch.tensor(float("nan"), dtype=t.dtype), t)
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_fold_and_logit_grad_in_c_are_the_compositions_bit_for_bit(unfused, dtype):
    """The LM head's per-chunk row arithmetic in C against fixed_order's compositions: a first and a
    later chunk of the online log-sum-exp, both as one call's pieces (lse_fold's width; the later one
    shorter) from nothing and after a first chunk, and the logits' gradient in fp32 and bf16, at
    lengths below, at and past the sum's 512 lanes, at temperatures 1 and 0.7, with NaN, Inf and
    -inf logits, a NaN running max and a target in and outside the chunk, on 1 and 2 threads. NaN is
    compared as NaN (`_bits`)."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(7)
    for length in (1, 3, 100, 512, 513, 4096):
        rows = 37
        first, later = ((torch.randn(rows, length, generator=gen) * 4).to(dtype) for _ in range(2))
        first[1, length // 2] = float("nan")
        first[2, 0] = float("inf")
        later[3] = float("-inf")
        later[4] = -0.0
        later[5, length - 1] = float("inf")
        lse = torch.randn(rows, generator=gen) + 8
        lse[6] = float("nan")
        local = torch.randint(0, length, (rows,), generator=gen)
        inside = (torch.rand(rows, generator=gen) < 0.5).float()
        scale = torch.randn(rows, generator=gen)
        wide = torch.randn(rows, length + 3, generator=gen).to(dtype)
        wide[:, :length] = later
        later = wide[:, :length]                             # rows length + 3 elements apart
        pieces = torch.cat([first, later[:, :max(1, length // 2)]], dim=1)
        for temperature in (1.0, 0.7):
            for threads in (1, 2):
                results = []
                for kernels in (unfused, KERNELS.name):
                    with num_threads(threads), fo.cpu_kernels(kernels):
                        run = fo.lse_fold(first, temperature, None)
                        nan_run = (run[0].clone(), run[1])
                        nan_run[0][7] = float("nan")
                        results.append((*run, *fo.lse_fold(later, temperature, run),
                                        *fo.lse_fold(later, temperature, nan_run),
                                        *fo.lse_fold(pieces, temperature, None, width=length),
                                        *fo.lse_fold(pieces, temperature, run, width=length),
                                        *(fo.logit_grad(chunk, temperature, lse, local, inside, scale, out)
                                          for chunk in (first, later) for out in (torch.float32, torch.bfloat16))))
                for i, (want, got) in enumerate(zip(*results)):
                    assert want.dtype == got.dtype and torch.equal(_bits(want), _bits(got)), \
                        (i, length, temperature, threads)


def test_a_row_max_is_the_first_of_its_value_on_every_instruction_set(isa):
    """The row max of the C row kernels (the online log-sum-exp's running max here) is found lane by
    lane, yet is the one a scalar loop from -inf keeps: where the largest value is zero, the first
    zero, of either sign, at any position around the 16 lanes; the first NaN; -inf for -inf rows."""
    from lockstep.backends.native import rows

    length = 20_000  # 6 rows of it run on 2 threads
    x = -torch.rand(6, length) - 0.5
    x[0, 7], x[0, 40] = -0.0, 0.0
    x[1, 7], x[1, 40] = 0.0, -0.0
    x[2, 97], x[2, 98] = -0.0, 0.0                            # past the last whole 16 lanes
    x[3, 16], x[3, 1] = 0.0, -0.0
    x[4, 50] = float("nan")
    x[5] = float("-inf")
    want = torch.tensor([-0.0, 0.0, -0.0, -0.0, float("nan"), float("-inf")])
    for name in build.supported_isas():
        isa(name)
        for threads in (1, 2):
            with num_threads(threads):
                run_max, _ = rows.lse_fold(x, 1.0, None)
            assert torch.equal(_bits(run_max), _bits(want)), (name, threads)


def test_the_logit_row_kernels_name_a_bad_argument():
    from lockstep.backends.native import rows

    chunk = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"local: expected shape \[3\], got \[2\]"):
        rows.logit_grad(chunk, 1.0, torch.zeros(3), torch.zeros(2, dtype=torch.int64), torch.zeros(3), torch.ones(3),
                        torch.float32)
    with pytest.raises(ValueError, match=r"run sum: expected shape \[3\], got \[3, 1\]"):
        rows.lse_fold(chunk, 1.0, (torch.zeros(3), torch.zeros(3, 1)))
    with pytest.raises(ValueError, match="width: expected a positive number of columns, got 0"):
        rows.lse_fold(chunk, 1.0, None, width=0)
    from lockstep.numerics import fixed_order as fo

    with fo.cpu_kernels("torch"), pytest.raises(ValueError, match="width: expected a positive number of columns, "
                                                                 "got -1"):
        fo.lse_fold(chunk, 1.0, None, width=-1)
    with pytest.raises(ValueError, match="out_dtype: expected torch.float32 or torch.bfloat16, got torch.float16"):
        rows.logit_grad(chunk, 1.0, torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3), torch.float16)
    with pytest.raises(RuntimeError, match="ls_logit_rows refused mode 1"):
        rows.logit_grad(chunk, 1.0, torch.zeros(3), torch.full((3,), 8), torch.zeros(3), torch.ones(3), torch.float32)


def test_bf16_gemm_order_is_the_documented_one():
    """kernels.c's bf16 order restated in Python (K = 75: two full 32-element chunks and a
    zero-filled one): lane j of chunk c adds the product of element 32 c + 2 j + 1, then of 32 c + 2 j,
    each by one fma, then the 16 lanes fold. And the flush at the smallest normal that the order
    defines (tininess after rounding with an unbounded exponent): a dot that plain rounding leaves at
    2^-126 is 0."""
    from lockstep.tools.backend_bits import BF16_TININESS

    gen = torch.Generator().manual_seed(8)
    k = 75
    a, b = (torch.randn(n, k, generator=gen).bfloat16() for n in (3, 5))
    got = gemm.gemm_nt(a, b)
    af, bf = (torch.nn.functional.pad(t.float(), (0, 96 - k)) for t in (a, b))
    for i in range(3):
        for j in range(5):
            lanes = torch.zeros(16)
            for c in range(0, 96, 32):
                for odd in (1, 0):
                    idx = torch.arange(16) * 2 + c + odd
                    lanes = _fma32(af[i, idx], bf[j, idx], lanes)
            t = lanes[:8] + lanes[8:]
            u = t[:4] + t[4:]
            v = u[:2] + u[2:]
            assert torch.equal(got[i, j], v[0] + v[1]), (i, j)
    x, y = BF16_TININESS
    assert gemm.gemm_nt(x[None], y[None]).item() == 0.0
    assert (x.double() * y.double()).sum().item() > 0.99 * 2.0 ** -126     # the exact dot: just below 2^-126


# ATen ops whose value on floating-point tensors is exact (IEEE-rounded arithmetic, moves, selections,
# comparisons), so their bits cannot follow the thread count, the instruction set or the BLAS.
# scatter_add, and cumsum (the sampler's top-p), run serially in index order on the CPU. Two are exact
# only in some calls (`_exact_call`): index_put with accumulate (parallel on several threads, so its
# sums at a repeated index change from run to run) with unique indices, and add / sub / rsub with
# alpha 1 or -1 (the vector kernels fuse alpha into an FMA). Anything else (mm and the BLAS, sum,
# softmax, exp, tanh, pow with a general exponent, ...) reduces or rounds in an order of PyTorch's
# kernels and would make the native backend's bits the machine's. sqrt and rsqrt are not here: ATen
# sends them through MKL's vector math, which picks its code by the CPU's maker (on this AMD EPYC one
# fp32 torch.sqrt in five is an ulp off the IEEE root, and float64 rsqrt gives other bits on QEMU's
# Haswell than here; docs/adr/0021).
EXACT_ATEN_OPS = frozenset("""
    _local_scalar_dense _to_copy _unsafe_view abs alias amax amin argmax argmin as_strided cat ceil clamp
    clamp_ clamp_max clamp_min clone constant_pad_nd copy_ cummax cummin cumsum detach div div_ empty empty_like
    empty_strided eq expand fill fill_ flip floor frexp full full_like gather ge gt index index_copy index_copy_
    index_select isfinite isinf isnan le lift_fresh lt masked_fill masked_fill_ max maximum min
    minimum mul mul_ nan_to_num narrow ne neg neg_ new_empty new_empty_strided new_full new_ones new_zeros ones
    ones_like permute reciprocal reciprocal_ repeat round scalar_tensor scatter scatter_ scatter_add
    select select_backward sign slice slice_backward sort split split_with_sizes squeeze stack t topk
    transpose tril triu trunc unbind unsqueeze view where zero_ zeros zeros_like
""".split())


def _exact_call(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether one call of an op outside EXACT_ATEN_OPS is exact all the same (see above)."""
    if name in ("add", "add_", "sub", "sub_", "rsub"):
        return kwargs.get("alpha", 1) in (1, -1)
    if name in ("index_put", "index_put_"):
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        indices = [i for i in args[1] if i is not None]
        if not accumulate or any(i.dtype == torch.bool for i in indices):
            return True
        rows = torch.stack([i.reshape(-1) for i in torch.broadcast_tensors(*indices)], 1)
        return torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    return name == "pow" and args[1:2] in ((2,), (2.0,))          # x * x


class _AtenAudit(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each ATen op that touches a floating-point tensor and is not in EXACT_ATEN_OPS, with
    the lockstep frames that called it."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()
        self.inexact: dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.is_floating_point() for t in tensors):
            name = func.overloadpacket.__name__
            self.seen.add(name)
            exact = name in EXACT_ATEN_OPS or _exact_call(name, args, kwargs or {})
            if not exact and str(func) not in self.inexact:
                frames = [f"{f.filename.rsplit('/src/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack()
                          if "/src/lockstep/" in f.filename]
                # The harness draws each call's padding rows: the workload's input, not lockstep's arithmetic.
                if not (name in ("randn", "rand") and frames and frames[-1].startswith("lockstep/harness/")):
                    self.inexact[str(func)] = " < ".join(reversed(frames[-3:]))
        return out


def _native_workload() -> list:
    """What lockstep runs on a CPU, as calls whose inputs and models are built beforehand (random
    inputs are the workload's, not lockstep's arithmetic): every op forward and backward (fp32, bf16,
    fp16, float64), attention by prefill and paged decode and masked attention, a training step of a
    dense, a Gemma 3 and an MoE model (fp32, bf16 with fp32 master weights, float64), and the engine
    sampling an MoE model with top-k and top-p."""
    from lockstep import Engine, SamplingParams
    from lockstep.harness.attention_check import AttnCase, paged_decode
    from lockstep.harness.check import Pool, run
    from lockstep.harness.masked_attention_check import MaskedCase
    from lockstep.harness.specs import SPECS, Sizes
    from lockstep.model import ModelConfig, Transformer

    from lockstep.tools.backend_bits import ATTN, MASKED, tiny_trainer

    sizes = Sizes(hidden=40, out_features=24, heads=2, head_dim=8, ffn=24, vocab=300, lm_hidden=16, embed_vocab=20,
                  pool=12)
    calls = []
    for dtype in DTYPES + [torch.float64]:
        for spec in SPECS.values():
            pool = Pool(spec, dtype, sizes, seed=0, grad=spec.differentiable)
            calls.append(lambda pool=pool: run(pool, "native", list(range(sizes.pool))))
        case, masked = AttnCase(dtype, ATTN, seed=0), MaskedCase(dtype, MASKED, seed=0)
        calls.append(lambda case=case: case.prefill("native", list(range(len(case.seqs))), grad=True))
        calls.append(lambda case=case: paged_decode(case, "native"))
        calls.append(lambda masked=masked: masked.run("native", list(range(len(masked.seqs))), grad=True, left=True))
    tokens = torch.randint(0, 300, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    for family in ("qwen3", "gemma3_text", "qwen3_moe"):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            calls.append(tiny_trainer(family, dtype, tokens).step)
    for family, sampling in (
            ("qwen3_moe", SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_new_tokens=6, seed=1)),
            ("gemma3_text", SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.3, max_new_tokens=6,
                                           seed=2))):
        softcap = 30.0 if family == "gemma3_text" else None
        config = ModelConfig.tiny(family, vocab_size=300, final_logit_softcapping=softcap)
        engine = Engine(Transformer.from_config(config, seed=0), block_size=4, num_blocks=40)
        calls.append(lambda engine=engine, sampling=sampling: engine.generate([tokens[:9], tokens[9:14]], sampling))
    return calls


def test_nothing_lockstep_runs_on_the_native_backend_reduces_in_pytorchs_order():
    """The thread count and instruction set move PyTorch's reductions and vector math (MKL re-blocks
    fp32 GEMMs with the thread count on an Intel Xeon, issue 27), so the native backend's bits are
    machine-independent only if no such op runs. The ops, their gradients, the models around them,
    the trainer's step and the engine's sampler dispatch only exact ATen ops on floating-point data."""
    assert registry.cpu_backend() == "native"
    calls = _native_workload()
    audit = _AtenAudit()
    with audit:
        for call in calls:
            call()
    assert {"add", "mul", "copy_", "index_put"} <= audit.seen and len(audit.seen) > 40, sorted(audit.seen)
    assert not audit.inexact, "\n".join(f"{op}: {where}" for op, where in sorted(audit.inexact.items()))
    planted = _AtenAudit()
    with planted:
        torch.ones(3, 4) @ torch.ones(4, 2)
        torch.exp(torch.ones(3))
        torch.add(torch.ones(3), torch.ones(3), alpha=0.3)
        torch.zeros(3).index_put_((torch.tensor([0, 0]),), torch.ones(2), accumulate=True)
        torch.sqrt(torch.ones(3))
    assert set(planted.inexact) == {"aten.mm.default", "aten.exp.default", "aten.add.Tensor",
                                    "aten.index_put_.default", "aten.sqrt.default"}, planted.inexact
