"""The native backend's bits (docs/adr/0010-native-cpu-backend.md, docs/adr/0026): the recorded ones
on every instruction set, thread count, thread pool, compiler, BLAS selection and emulated CPU, an
aarch64 build under QEMU among them, and `lockstep check`'s comparison with the recording.

The op-by-op invariance sweeps (rows, batch composition, padding, chunking, paged decode) run on
the native backend in each op's own test file, since it is the CPU's default backend."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.tools import bench
from lockstep import registry
from lockstep.tools import backend_bits
from lockstep.backends.native import bits, build, gemm

from _native_helpers import FALLBACK_LINE, ISA_FLAGS, without_compiler
from test_cpu_kernels import ATEN_CAPABILITIES, MKL_ISAS, ONEDNN_ISAS, cpu_flags, cpu_vendor, require


ROOT = Path(__file__).resolve().parent.parent
DIGEST = Path(__file__).with_name("_native_digest.py")


def digest(env: dict[str, str], threads: str = "1,2,3", *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", str(DIGEST), *args, "--threads", threads],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def widest() -> dict:
    return digest({})


@pytest.fixture(scope="module")
def widest_small() -> dict:
    """This machine's digests of the smaller workload (tests/_native_digest.py --small) that an
    emulated CPU runs, on the threads it runs them on; `widest` ties this machine's to the recording."""
    return digest({}, ",".join(sorted({n for *_, threads in INTEL_CPUS.values() for n in threads.split(",")})),
                  "--small")


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
    machine's cc: every op of the digest, forward and backward, in fp32, bf16 and fp16, on every
    instruction set this CPU runs, gives the first build's bits: the widest on 1, 2 and 3 threads,
    the others on 2 (their thread counts are swept on the first build, in the tests above). Unforced,
    the clang build picks the same widest instruction set: its CPU detection does not lean on the
    compiler's runtime library (zig's leaves __builtin_cpu_supports' table empty)."""
    env = {"CC": f"{shlex.quote(sys.executable)} -m ziglang cc", "LOCKSTEP_CACHE_DIR": str(tmp_path)}
    got = digest(env)
    assert "clang" in got["compiler"] and got["compiler"] != widest["compiler"], (got["compiler"], widest["compiler"])
    assert got["isa"] == widest["isa"]
    assert got["digests"] == widest["digests"]
    for name in build.supported_isas()[:-1]:
        forced = digest({**env, "LOCKSTEP_CPU_ISA": name}, threads="2")
        assert forced["isa"] == name
        assert forced["digests"] == {"2": widest["digests"]["2"]}, name
    assert len(list(tmp_path.glob("native-*.so"))) == 1  # one build, by clang, ran every digest


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
# so it runs three; Sandy Bridge adds the scalar path and ATen's default kernels, on 2 threads. Both
# run the smaller workload (every section and path, fewer multiply-adds: _native_digest.SMALL), since
# TCG runs vector and scalar arithmetic alike one helper call at a time; the recorded workload runs
# natively on every instruction set (test_every_instruction_set_gives_the_same_bits_for_every_op).
INTEL_CPUS = {"Haswell-v4": ("avx2", "AVX2", "1,2,3"), "SandyBridge": ("scalar", "DEFAULT", "2")}
# On a GenuineIntel host MKL takes its Intel paths without an emulator, and Haswell's are reached by
# capping each library at AVX2, without TCG's cost (ADR 0029's later section). Sandy Bridge stays
# emulated everywhere: only a CPU without AVX2 and FMA shows that the scalar path executes none of
# their instructions.
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
def test_an_emulated_intel_cpu_gives_the_bits_of_this_one(model, request):
    """The Xeon's failure (ADR 0024) came from MKL's Intel code paths, which re-block fp32 GEMMs with the
    thread count; they run only where CPUID says GenuineIntel. Under QEMU's user-mode emulation of an
    Intel CPU they run here: stock fp32 `F.linear` on Haswell gives other bits on 1 and 2 threads
    (checked first, so the emulation is known to reach them). The native backend, whose instruction
    set is the one it finds in that CPUID (AVX2; scalar on Sandy Bridge, with ATen's default
    kernels), gives this machine's digest of the smaller workload, computed here too: every op,
    forward and backward, fp32, bf16 and fp16, two trainer steps (AdamW's root included) and a random
    model's weights, on 1, 2 and 3 threads (Sandy Bridge on 2: INTEL_CPUS).
    TCG has no AVX-512, so the AVX-512 paths on Intel run only on hardware. On a GenuineIntel host
    with AVX2, Haswell's paths run natively instead, each library capped at AVX2 (NATIVE_CAPS): the
    instruction set is then forced, not found, and an AVX-512 instruction on the AVX2 path would not
    trap there (an AMD host's QEMU run shows both)."""
    isa, aten, threads = INTEL_CPUS[model]
    widest, here = request.getfixturevalue("widest"), request.getfixturevalue("widest_small")
    assert here["digests"]["2"].keys() == widest["digests"]["2"].keys()
    emulator, env = _as_intel_cpu(model)
    stock = ["--stock-linear"] if model == "Haswell-v4" else []
    proc = subprocess.run([*emulator, sys.executable, "-W", "ignore", str(DIGEST), "--small", *stock,
                           "--threads", threads], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["isa"], got["aten"]) == (isa, aten)
    if model == "Haswell-v4":
        assert got["stock_linear"]["1"] != got["stock_linear"]["2"], "MKL's Intel path did not re-block"
    assert got["digests"] == {n: here["digests"][n] for n in threads.split(",")}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates x86-64 CPUs in user mode; CI runs x86-64")
def test_on_an_emulated_intel_cpu_the_fallback_line_says_what_the_portable_backend_loses(tmp_path):
    """On QEMU's Haswell, MKL's fp32 GEMM changes a row's bits with the tile's row count and a
    column's with the call's width, the two premises of the portable backend's invariance: without
    a compiler (CC=/bin/false, nothing on PATH), the line that says why the native backend is not in
    use also says that, and so does `lockstep check --backend portable`, whose batch sweep fails
    there (one process: TCG makes each start costly). On a GenuineIntel host with AVX2, MKL's AVX2
    path runs natively instead (NATIVE_CAPS), with the same verdicts; uncapped, MKL's AVX-512 path
    breaks the row tiles alone, so the column widths here also show that the cap took."""
    emulator, env = _as_intel_cpu("Haswell-v4")  # QEMU by its full path: PATH is emptied for the child
    caveat = ("PyTorch's fp32 GEMMs here break the row tiles and column widths that the portable backend rests on, "
              "so it has no batch invariance or tensor-parallel invariance on this machine at 2 threads "
              "(docs/contract.md, section 7)")
    env = {**without_compiler(tmp_path, env), "OMP_NUM_THREADS": "2"}
    check = subprocess.run([*emulator, sys.executable, "-m", "lockstep", "check", "--backend", "portable", "linear",
                            "--dtype", "fp32", "--no-grad"], env=env, capture_output=True, text=True, timeout=600)
    assert check.returncode == 1, check.stderr[-3000:]
    assert [line for line in check.stderr.splitlines() if "native CPU backend" in line] == \
        [f"{FALLBACK_LINE}; {caveat}"], check.stderr[-3000:]
    first, *_, row, _, summary = check.stdout.splitlines()
    assert first.startswith("lockstep check: backend=portable threads=2 ") and first.endswith(f"; {caveat}"), first
    assert row.split()[:2] == ["linear", "float32"] and "FAIL batch=1" in row, row
    assert summary.startswith("0 passed, 1 failed"), summary


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
