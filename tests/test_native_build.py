"""Building and running the native kernels (build.py, docs/adr/0025): the instruction sets found,
the compiler command, other platforms, the threads, and a build that falls short (no compiler, a
compiler too old for some paths, a failing machine, a cache folder that cannot be written, processes
compiling together, a broken cached file, no file locks), each saying why in one line."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lockstep import ops, registry
from lockstep.tools import backend_bits
from lockstep.backends.native import build, gemm
from lockstep.harness.check import num_threads

from _alongside import Alongside
from _native_helpers import FALLBACK_LINE, ISA_FLAGS, _fallback_lines
from test_cpu_kernels import cpu_flags, require


def test_the_instruction_sets_found_are_the_ones_the_cpu_reports():
    """isa.c reads CPUID and XGETBV itself; it finds what the OS's /proc/cpuinfo flags report
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


PLATFORMS = ["aarch64-linux-gnu", "x86_64-macos", "aarch64-macos", "x86_64-linux-musl"]


@pytest.fixture(scope="module")
def cross_compiles(tmp_path_factory):
    """{target: the object file}, and the compiles that make them, side by side (tests/_alongside.py)."""
    folder, flags = tmp_path_factory.mktemp("cross"), [f for f in build.FLAGS if f != "-shared"]
    objects = {target: folder / f"kernels-{target}.o" for target in PLATFORMS}
    compiles = Alongside({target: ([sys.executable, "-m", "ziglang", "cc", "-target", target, *flags, "-Wall",
                                    "-Werror", "-c", "-o", str(obj), str(build.SOURCE)], None)
                          for target, obj in objects.items()}, timeout=300)
    yield objects, compiles
    compiles.stop()


@pytest.mark.parametrize("target", PLATFORMS)
def test_the_kernels_compile_for_other_platforms(target, cross_compiles):
    """kernels.c compiles, with the build's flags and warnings as errors, for ARM Linux, both Macs
    and musl (zig's clang cross-compiles): no x86 code outside its guards, no glibc-only call. This
    says nothing of the bits there; only x86-64 Linux has run them."""
    objects, compiles = cross_compiles
    done = compiles.result(target)
    assert done.returncode == 0, done.stderr[-3000:]
    assert objects[target].stat().st_size > 0


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


def test_a_forced_instruction_set_must_be_known_and_runnable(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match=r"LOCKSTEP_CPU_ISA: expected one of \['scalar', 'avx2', 'avx512', 'avx512bf16'\], got 'sse9'"):
        build.isa()
    missing = [name for name in build.ISAS if name not in build.supported_isas()]
    if missing:
        monkeypatch.setenv("LOCKSTEP_CPU_ISA", missing[-1])
        with pytest.raises(ValueError, match="this CPU does not run"):
            build.isa()


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
    that the real compiler made once, to the -o file instead of compiling again (None: the real
    compiler compiles). With `processes` > 1 a build first waits (up to 120 s) until that many
    processes have asked for the version, which each does just before it takes the build's lock,
    and then 2 s more: the others find it compiling, however far apart they started.
    With `builds`, it stands in for a compiler too old for some of kernels.c's intrinsics (named
    old-cc): it builds only when the define `builds` is among its arguments, and otherwise fails as
    GCC 4.8 fails on AVX-512 code, its error after the line that names the function. Returns CC's
    value, quoted as a shell would need it. The calls' extension (backends/native/calls.py) is
    not kernels.c: the real compiler builds it."""
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
  *"/_lockstep_calls.c "*) exec {real} "$@" ;;
esac
{refuse}{make}""")
    script.chmod(0o755)
    return shlex.quote(str(script))


@pytest.fixture(scope="module")
def reduced_build(tmp_path_factory):
    """kernels.c as the real compiler builds it with a define (-DLS_NO_DPBF16, -DLS_NO_X86), both
    compiled side by side on first use (tests/_alongside.py) and shared by the tests that need them."""
    folder, cc = tmp_path_factory.mktemp("reduced-builds"), build.compiler()
    made = {define: folder / f"kernels{define}.so" for (define,), _ in build.BUILDS[1:]}
    compiles = Alongside({define: (build.compile_command(cc, [define], str(so)), None) for define, so in made.items()})

    def get(define: str) -> Path:
        done = compiles.result(define)
        assert done.returncode == 0, done.stderr
        return made[define]
    yield get
    compiles.stop()


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
        with pytest.raises(RuntimeError, match=r"^ls_gemm_nt_group refused a \[2, 3\] torch.bfloat16 input to "
                                               r"\[\(4, 3\)\] \[torch.bfloat16\]$"):
            gemm.gemm_nt_group_in_layout(torch.ones(2, 3, dtype=torch.bfloat16), [torch.ones(4, 3, dtype=torch.bfloat16)],
                                         [None], torch.bfloat16)
