"""Build and load the native kernels (kernels.c, which includes the other C files beside it) with
the machine's C compiler.

The library is compiled on first use into a cache folder and reused while the sources, the compiler
and the flags stay the same: a fresh Linux machine needs only `cc`, no CUDA and no second torch.
CC picks another compiler, as a command as make takes it ("clang", "ccache gcc", "zig cc"); the bits
do not depend on which one builds it (tests build with GCC and with clang).
Anything that stops the build or the load raises `NativeUnavailable` with the reason, which the
registry prints in one line before it falls back to the portable backend.

LOCKSTEP_CPU_ISA=scalar|avx2|avx512|avx512bf16 forces an instruction set (all give the same bits;
tests run each on one machine); unset, the widest one that the CPU runs and the build has is used
(a compiler too old for some paths builds the file without them: BUILDS). avx512bf16 is the
AVX-512 path with the VDPBF16PS instruction for bf16 products, offered only where the instruction
passes a self-test against the bf16 order's definition (kernels.c).
Parallel work runs on torch's own OpenMP threads when torch runs on an OpenMP runtime that offers
GCC's entry point (libgomp, or Intel's libiomp5); otherwise on the library's own threads.
LOCKSTEP_NATIVE_POOL=own forces the library's threads (the bits are the same: threads divide whole
outputs).
LOCKSTEP_CACHE_DIR overrides the cache folder (default: $XDG_CACHE_HOME/lockstep or ~/.cache/lockstep).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from .program import active as _recording
except ImportError:     # build.py run alone (bits.py as a script, under QEMU): no thread records there
    def _recording():
        return None

SOURCE = Path(__file__).with_name("kernels.c")
# What the cache key reads: kernels.c is one translation unit with the files it includes, so a
# change to any of them is a change to the library.
SOURCES = tuple(sorted(p for p in SOURCE.parent.iterdir() if p.suffix in (".c", ".h")))
# -ffp-contract=off: the compiler must not fuse a multiply and an add that the source keeps apart.
# -frounding-math: nor move arithmetic across the MXCSR changes around the bf16 tiles.
FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-fast-math", "-frounding-math"]
# What each build leaves out, widest first. A compiler that cannot build the whole file (AVX-512
# intrinsics it does not know, say) builds the next one, on the paths it can: the same bits, fewer
# instruction sets. Only when none builds does the portable backend run, whose bits differ.
BUILDS = (([], ""), (["-DLS_NO_DPBF16"], "the VDPBF16PS path"), (["-DLS_NO_X86"], "the x86 vector paths"))
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}
POOLS = ("openmp", "own")
ABI_VERSION = 15


class NativeUnavailable(RuntimeError):
    """The native backend cannot run on this machine; the message says why."""


def cache_dir() -> Path:
    if os.environ.get("LOCKSTEP_CACHE_DIR"):
        return Path(os.environ["LOCKSTEP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lockstep"


def compiler() -> list[str]:
    """The command that compiles kernels.c: $CC when set (split as a shell would, so "ccache gcc" and
    "zig cc" work), else the first of cc, gcc and clang on PATH."""
    asked = os.environ.get("CC", "").strip()
    if asked:
        try:
            argv = shlex.split(asked)
        except ValueError as e:
            raise NativeUnavailable(f"CC={asked!r} cannot be split into a command: {e}") from e
        path = shutil.which(argv[0])
        if path is None:
            raise NativeUnavailable(f"CC={asked!r}: {argv[0]!r} was not found on PATH")
        return [path, *argv[1:]]
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise NativeUnavailable("no C compiler found (looked for $CC, cc, gcc and clang)")


def compiler_version(cc: list[str]) -> str:
    """What `cc --version` prints: part of the cache key (with the command itself), so another
    compiler, or the same one with other arguments in CC, builds its own file."""
    return subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout


def assembler_version(cc: list[str]) -> str:
    """What the assembler `cc` runs says its version is ("" where `cc` does not name one): it decides
    whether the VDPBF16PS path builds (binutils before 2.33 does not know the instruction), and an
    upgrade of it alone must not leave a build without that path in the cache."""
    try:
        name = subprocess.run([*cc, "-print-prog-name=as"], capture_output=True, text=True, timeout=60).stdout.strip()
        path = shutil.which(name) if name else None
        return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout if path else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def cached_library(cc: list[str]) -> Path:
    """Where the library that `cc` builds is cached: named by the sources, the flags, the builds
    tried, the command and what it and its assembler say their versions are."""
    versions = [compiler_version(cc), assembler_version(cc)]
    named = "\0".join([*cc, *FLAGS, repr(BUILDS), *versions])
    # Each file by its name and its bytes' digest: a file renamed, or bytes moved from one file to
    # another, names another library.
    sources = b"".join(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest() for p in SOURCES)
    key = hashlib.sha256(sources + named.encode()).hexdigest()[:16]
    return cache_dir() / f"native-{key}.so"


def _scratch_folder() -> Path:
    """A temporary folder for this process's own build, removed at exit."""
    scratch = Path(tempfile.mkdtemp(prefix="lockstep-native-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch


def _writable(folder: Path) -> Path:
    """`folder`, created if need be; where it cannot be written (a read-only home, a file in the
    way), a temporary folder, after one line that says so. The build must not fail over where it
    is kept: the fallback would change the bits."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder)
        os.close(fd)
        os.unlink(probe)
        return folder
    except OSError as e:
        scratch = _scratch_folder()
        logging.getLogger("lockstep").warning(
            "lockstep: the native kernels' cache folder %s cannot be written (%s); they are compiled for this "
            "process alone, in %s (LOCKSTEP_CACHE_DIR names another folder)", folder, e.strerror or e, scratch)
        return scratch


def _lock(target: Path) -> int | None:
    """An exclusive lock on a file beside `target` (its descriptor), so that one of the processes
    that start together (torchrun's ranks, test workers) compiles while the others wait for its
    file; None where the folder or the file system gives no lock, and each process compiles."""
    import fcntl  # POSIX; library() refuses Windows before it gets here

    try:
        # Read-only: a lock file another user created still locks.
        fd = os.open(target.with_suffix(".lock"), os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("lockstep").warning("lockstep: waiting for another process to compile the native CPU "
                                                  "kernels into %s", target.parent)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def _name(cc: list[str]) -> str:
    return " ".join([Path(cc[0]).name, *cc[1:]])


# A compile that failed for the machine's sake, not the source's: another attempt, with fewer paths,
# must not be cached in place of the whole file.
_PASSING_FAILURES = ("Killed signal", "internal compiler error", "No space left on device", "Cannot allocate memory")


def compile_command(cc: list[str], defines: list[str], out: str) -> list[str]:
    """The command that compiles kernels.c with `defines` (BUILDS) into the shared library `out`."""
    return [*cc, *FLAGS, *defines, "-o", out, str(SOURCE), "-lm"]


def _compile_widest(cc: list[str], out: str) -> tuple[str, str]:
    """Compile kernels.c into `out` as the first of BUILDS that `cc` can build: (what it left out,
    the whole file's first error), ("", "") for the whole file. NativeUnavailable, with the whole
    file's first error, when none builds or the compile failed for a passing reason (killed, out
    of memory or disk, an internal compiler error)."""
    first_error = ""
    for defines, left_out in BUILDS:
        done = subprocess.run(compile_command(cc, defines, out), capture_output=True, text=True)
        if done.returncode == 0:
            return left_out, first_error
        lines = done.stderr.strip().splitlines()
        # Not "In file included from ...", "gemm.c: In function ...", nor "Assembler messages:": the
        # line that says what failed.
        error = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "(no message)")
        first_error = first_error or error
        if done.returncode < 0 or any(reason in done.stderr for reason in _PASSING_FAILURES):
            raise NativeUnavailable(f"{_name(cc)} could not compile {SOURCE.name}: {error}")
    raise NativeUnavailable(f"{_name(cc)} could not compile {SOURCE.name}: {first_error}")


def _compile(cc: list[str], folder: Path | None = None, rebuild: bool = False) -> Path:
    """The library `cc` builds: from the cache folder, compiled into it on first use (seconds of a
    core), or compiled into `folder` when one is given. `rebuild`: compile even over a file
    already there (one that would not load)."""
    cached = cached_library(cc)
    if folder is None and cached.exists() and not rebuild:
        return cached
    target = (folder or _writable(cached.parent)) / cached.name
    lock = _lock(target)
    try:
        if target.exists() and not rebuild:  # another process compiled it while this one waited
            return target
        kept = "kept for this kernel source and compiler" if target == cached else "for this process alone"
        logging.getLogger("lockstep").warning("lockstep: compiling the native CPU kernels into %s (%s)",
                                              target.parent, kept)
        # Compile beside the target and rename: a process never loads a partial file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            left_out, error = _compile_widest(cc, tmp)
            if left_out:
                logging.getLogger("lockstep").warning(
                    "lockstep: %s could not compile all of %s (%s); built it without %s, with the same bits, but a "
                    "CPU that runs those instructions leaves them unused (CC picks another compiler; delete %s to "
                    "compile again)", _name(cc), SOURCE.name, error, left_out, target)
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of a shared cache out
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())  # a crash must not leave a short file under the final name
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    finally:
        if lock is not None:
            os.close(lock)
    return target


def library():
    """The loaded kernel library (built on first use), its entry points called through a compiled
    extension where one builds (calls.py; else ctypes'); raises NativeUnavailable. A thread that
    records its kernel calls (program.py) gets it wrapped, each call kept."""
    recording = _recording()
    return _library() if recording is None else recording.wrap(_library())


@functools.cache
def _library():
    if sys.platform == "win32":
        raise NativeUnavailable("the native kernels are built for Linux and macOS only")
    cc = compiler()
    try:
        path = _compile(cc)
    except OSError as e:
        raise NativeUnavailable(f"the kernels could not be compiled: {e}") from e
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        # A cached file that does not load (cut short, or unreadable to this user) must not send the
        # process to the portable backend: compile it again, over the broken one where it can.
        logging.getLogger("lockstep").warning("lockstep: the cached native kernels %s could not be loaded (%s); "
                                              "compiling them again", path, e)
        try:
            try:
                path = _compile(cc, rebuild=True)
            except OSError:  # the broken file cannot be replaced here
                path = _compile(cc, _scratch_folder())
            lib = ctypes.CDLL(str(path))
        except OSError as e2:
            raise NativeUnavailable(f"the compiled kernels could not be loaded: {e2}") from e2
    if lib.ls_abi_version() != ABI_VERSION:
        raise NativeUnavailable(f"kernel library ABI {lib.ls_abi_version()}, expected {ABI_VERSION}")
    lib = declare(lib)
    lib.ls_use_openmp(_gomp_parallel(_pool_asked()))
    # Here, not at the top: this file's top level stays the standard library's (bits.py runs it alone).
    from .calls import bind

    return bind(lib, SIGNATURES, cc, path.parent, compiler_version(cc))


def openmp_runtime() -> str | None:
    """The path of the OpenMP runtime that torch's threads run on in this process (libgomp, or
    libiomp5, which offers GCC's entry points too), or None (none loaded, or no /proc to look in)."""
    import torch  # noqa: F401  (loads the runtime torch links)

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(("libgomp", "libiomp5")):
            return fields[5]
    return None


def _pool_asked() -> str:
    return os.environ.get("LOCKSTEP_NATIVE_POOL") or "openmp"


def _gomp_parallel(pool: str) -> int | None:
    """The address of GOMP_parallel in torch's OpenMP runtime, for pool "openmp"; None for "own"
    or when there is no such runtime."""
    if pool not in POOLS:
        raise ValueError(f"LOCKSTEP_NATIVE_POOL: expected one of {list(POOLS)}, got {pool!r}")
    runtime = openmp_runtime() if pool == "openmp" else None
    if runtime is None:
        return None
    try:
        return ctypes.cast(ctypes.CDLL(runtime).GOMP_parallel, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def pool_name() -> str:
    """Which threads run the kernels' parallel work: "openmp" (torch's) or "own"."""
    library()
    return "openmp" if _gomp_parallel(_pool_asked()) else "own"


# kernels.c's exported functions: their arguments and result, one letter each: q int64_t, i int, p a pointer (an address as an int, or None for
# NULL), f float; v (a result only) void.
SIGNATURES = {
    # gemm.c
    "ls_gemm_nt": ("qqqqpqqpqqpqqpiiiii", "i"), "ls_gemm_nt_group": ("qqpq" + "pqqpqp" * 3 + "iiii", "i"),
    "ls_gemm_nt_tree": ("qqqpqpqpqqpiii", "i"), "ls_transpose": ("qqqpqqpqqii", "i"),
    # attention.c, attention_backward.c
    "ls_attention_fwd": ("qqqqpppqqppppqqpqfiqpppiii", "i"), "ls_attention_bwd": ("qqqqppppqqppppqfiqppppppiii", "i"),
    # rows.c: norms, activations, rope, row sums and log_softmax
    "ls_rms_norm_fwd": ("qqppffppiiiii", "i"), "ls_add_rms_norm_fwd": ("qqpppffpppiiiii", "i"),
    "ls_rms_norm_bwd": ("qqppppfpppqqiiiiii", "i"), "ls_silu": ("qpppppiiii", "i"),
    "ls_rope": ("qqqppppiiii", "i"), "ls_rope_kv": ("qqqq" + "p" * 9 + "qiiii", "i"), "ls_rows": ("qqpppiii", "i"),
    # exp_log.c, float64.c, lm_head.c
    "ls_unary": ("ppqiii", "i"), "ls_unary_f64": ("ppqiii", "i"), "ls_gemm_nt_f64": ("qqqqpqqpqqpqqpii", "i"),
    "ls_logit_rows": ("qqqpqifiipppppppiii", "i"),
    # isa.c, threads.c
    "ls_cpu_supports": ("i", "i"), "ls_cpu_isas": ("", "i"), "ls_built_isas": ("", "i"), "ls_use_openmp": ("p", "v"),
}
_CTYPES = {"q": ctypes.c_int64, "i": ctypes.c_int, "p": ctypes.c_void_p, "f": ctypes.c_float, "v": None}



def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the argument and result types of kernels.c's exported functions (SIGNATURES)."""
    for name, (args, result) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = [_CTYPES[code] for code in args]
        function.restype = _CTYPES[result]
    return lib


def supported_isas() -> list[str]:
    """The instruction sets the kernels run here (this CPU runs them and this build has their
    paths), narrowest first."""
    lib = library()
    return [name for name, code in ISAS.items() if lib.ls_cpu_supports(code)]


def unbuilt_isas() -> list[str]:
    """The instruction sets this CPU runs (AVX512_BF16 by CPUID alone, before the self-test) that
    this build has no path for, because its compiler could not build them (BUILDS; a compiler
    without AVX512_BF16's header, GCC before 10, leaves out that one); empty for a whole build."""
    lib = library()
    unbuilt = lib.ls_cpu_isas() & ~lib.ls_built_isas()
    return [name for name, code in ISAS.items() if unbuilt >> code & 1]


@functools.cache
def _isa_for(forced: str | None) -> int:
    supported = supported_isas()
    if forced is None:
        return ISAS[supported[-1]]
    if forced not in ISAS:
        raise ValueError(f"LOCKSTEP_CPU_ISA: expected one of {list(ISAS)}, got {forced!r}")
    if forced in unbuilt_isas():
        raise ValueError(f"LOCKSTEP_CPU_ISA: this CPU runs {forced!r}, but the compiler built the kernels without "
                         f"its path; they run {supported}")
    if forced not in supported:
        raise ValueError(f"LOCKSTEP_CPU_ISA: this CPU does not run {forced!r}; it runs {supported}")
    return ISAS[forced]


def isa() -> int:
    """The instruction-set code the kernels run with (LOCKSTEP_CPU_ISA, else the widest supported)."""
    return _isa_for(os.environ.get("LOCKSTEP_CPU_ISA") or None)


def isa_name() -> str:
    return {code: name for name, code in ISAS.items()}[isa()]
