"""`lockstep gpu-audit`: every Triton kernel of the backend compiled to real NVIDIA machine code on a
machine without a GPU, and what the machine code says about it.

Triton's compiler needs no GPU: given a target (GPUTarget("cuda", 90, 32)) it lowers a kernel to
PTX and, through the `ptxas` that the triton wheel ships, to a cubin. What is compiled is exactly
what the backend launches (lockstep.tools.gpu_launches records it). Each distinct launch is
compiled per architecture; ptxas's own report (-v) gives the stack frame and the spills,
`cuobjdump` (also in the wheel) registers and static shared memory, and `nvdisasm` the SASS, many
binaries to one process (lockstep.tools.sass).

Run it in a process of its own: the Triton backend must be imported with TRITON_INTERPRET=0,
and a process that has already imported it under the interpreter cannot switch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable

# First: gpu_launches sets TRITON_INTERPRET=0 before triton loads.
from .gpu_launches import DTYPES, ROWS, Launch, record, recording, workload
from . import sass  # noqa: E402

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, CompiledKernel  # noqa: E402
from triton.runtime.cache import get_cache_manager  # noqa: E402

__all__ = ["ARCHS", "DEFAULT_ARCHS", "DTYPES", "Launch", "ROWS", "audit", "compile_launch", "compile_with_ptxas_report",
           "disassembly", "occupancy", "opcodes", "parse_archs", "record", "recording", "resource_usage", "run",
           "sass_body", "table", "tensor_core", "workload"]

# --arch name -> compute capability.
ARCHS = {"sm_80": 80, "sm_90a": 90, "sm_100a": 100}
DEFAULT_ARCHS = ("sm_80", "sm_90a", "sm_100a")
# Most shared memory one block may use (static + dynamic, after opting in): CUDA C Programming
# Guide, "Features and Technical Specifications" (A100 163 KB, H100 and B200 227 KB).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
# Registers and resident warps per SM (the same on sm_80, sm_90 and sm_100).
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
SHARED_PER_SM = {80: 164 * 1024, 90: 228 * 1024, 100: 228 * 1024}
ATOMIC_OPCODES = {"ATOM", "ATOMS", "ATOMG", "RED", "REDG", "REDAS"}
# Shared-memory bit operations with which sm_100 code claims and frees tensor memory (paired with
# UTCATOMSWS, tcgen05.alloc's bookkeeping); they touch no data, so no result depends on their order.
ALLOCATOR_ATOMICS = {"ATOMS.OR", "ATOMS.AND"}
TRITON_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


# ---------------------------------------------------------------------------------------------
# Compiling and reading the machine code.
# ---------------------------------------------------------------------------------------------


def _tool(name: str, *args: str) -> str:
    path = os.path.join(TRITON_BIN, name)
    done = subprocess.run([path, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def _kept(kernel_hash: str, name: str, suffix: str) -> str | None:
    """The text kept next to a binary (its hash and kernel name) in Triton's cache as name + suffix."""
    path = get_cache_manager(kernel_hash).get_file(name + suffix)
    if path is None:
        return None
    with open(path) as f:
        return f.read()


def _keep(kernel_hash: str, name: str, suffix: str, text: str) -> None:
    get_cache_manager(kernel_hash).put(text, name + suffix, binary=False)


PTXAS_RAN = re.compile(r"^ptxas[\w-]* info", re.M)
PTXAS_FIGURES = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_with_ptxas_report(src: ASTSource, target: GPUTarget,
                              options: dict) -> tuple[CompiledKernel, dict[str, int]]:
    """triton.compile, and what ptxas -v said of the binary: {"stack": the stack frame, in bytes per
    thread; "spill_stores", "spill_loads": ptxas's count of the bytes that the code's spill
    instructions store and load, a static count, so a slot stored twice counts twice}.

    Spills are only in ptxas's report: they live in the stack frame, and cuobjdump's resource usage
    has no figure for them (its LOCAL counts .local arrays, which Triton never declares). Triton runs
    ptxas -v and prints the report when asked (knobs.nvidia.dump_ptxas_log). A compile that Triton's
    cache answers runs no ptxas, so the report is kept next to the binary in that cache, and a binary
    cached without one is compiled again."""
    always_compile = knobs.compilation.always_compile     # TRITON_ALWAYS_COMPILE, as the user set it

    def compiled(always: bool) -> tuple[CompiledKernel, str]:
        printed = io.StringIO()
        with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(printed):
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = always
            kernel = triton.compile(src, target=target, options=options)
        return kernel, printed.getvalue()

    kernel, report = compiled(always_compile)
    ran = bool(PTXAS_RAN.search(report))
    if not ran:
        report = _kept(kernel.hash, kernel.name, ".ptxas")
        if report is None:
            (kernel, report), ran = compiled(always=True), True
    figures = PTXAS_FIGURES.findall(report)
    if len(figures) != 1:
        raise RuntimeError(f"ptxas -v for {kernel.name}: expected one line '<N> bytes stack frame, <N> bytes spill "
                           f"stores, <N> bytes spill loads' in the report that Triton prints under "
                           f"knobs.nvidia.dump_ptxas_log, found {len(figures)}: {report[-2000:]!r}")
    if ran:
        _keep(kernel.hash, kernel.name, ".ptxas", report)
    return kernel, dict(zip(("stack", "spill_stores", "spill_loads"), map(int, figures[0])))


def resource_usage(cubin_path: str) -> dict[str, int]:
    """REG, STACK, SHARED (static) and LOCAL of the cubin's one function, from cuobjdump -res-usage
    (spills are not among them: see compile_with_ptxas_report)."""
    text = _tool("cuobjdump", "-res-usage", cubin_path)
    line = next((line for line in text.splitlines() if "REG:" in line), None)
    if line is None:
        raise RuntimeError(f"cuobjdump -res-usage {cubin_path}: no resource line in {text!r}")
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


# The suffix of a binary's SASS listing kept in Triton's cache (tools/sass.py's form).
LISTING = ".listing"


def _listings(arch: str, binaries: list[tuple[str, str, str]]) -> list[str]:
    """The SASS listing of each (kernel hash, kernel name, cubin path) of `arch`, from one disassembler
    process (tools/sass.py), each kept next to its binary in Triton's cache.

    The cache entry's key (the hash) covers the source, the target, the options and the ptxas
    version, and nvdisasm comes with that ptxas, so one entry has one listing: an audit whose
    compiles Triton's cache already holds starts no disassembler."""
    cubins = []
    for _, _, path in binaries:
        with open(path, "rb") as f:
            cubins.append(f.read())
    texts = sass.listings(os.path.join(TRITON_BIN, "nvdisasm"), arch, cubins)
    for (kernel_hash, name, _), text in zip(binaries, texts):
        _keep(kernel_hash, name, LISTING, text)
    return texts


def disassembly(kernel: CompiledKernel, cubin_path: str) -> str:
    """The SASS listing of `kernel`'s cubin (as `cuobjdump -sass` lists its instructions), kept next
    to the cubin in Triton's cache."""
    kept = _kept(kernel.hash, kernel.name, LISTING)
    if kept is not None:
        return kept
    arch = next(name for name, capability in ARCHS.items() if capability == kernel.metadata.target.arch)
    return _listings(arch, [(kernel.hash, kernel.name, cubin_path)])[0]


def opcodes(sass: str) -> list[str]:
    """The instruction mnemonics of cuobjdump -sass output, in order (predicates dropped)."""
    return re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", sass, re.M)


def tensor_core(ops: list[str]) -> str:
    """The MMA instruction family the SASS uses ("HMMA", "HGMMA", "UTCHMMA", ...), or "none"."""
    families = sorted({op.split(".")[0] for op in ops if "MMA" in op.split(".")[0]})
    return "+".join(families) if families else "none"


def _constexpr_json(v):
    return v if isinstance(v, (bool, int, float, str)) or v is None else repr(v)


def _compiled(launch: Launch, arch: str, out_dir: str) -> tuple[dict, tuple[str, str], str | None]:
    """Compile `launch` for `arch` and write its cubin under out_dir/arch: the record's fields that
    the SASS does not give, the binary's (hash, kernel name) in Triton's cache, and the listing the
    cache keeps for it, if any."""
    capability = ARCHS[arch]
    src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    kernel, ptxas = compile_with_ptxas_report(src, GPUTarget("cuda", capability, 32), dict(launch.options))
    cubin = kernel.asm["cubin"]
    digest = hashlib.sha256(cubin).hexdigest()[:16]
    folder = os.path.join(out_dir, arch)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{launch.kernel}-{digest}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    usage = resource_usage(path)
    record = {
        "kernel": launch.kernel,
        "arch": arch,
        "config": {k: _constexpr_json(v) for k, v in launch.config().items()},
        "signature": {k: v for k, v in launch.signature.items() if v != "constexpr"},
        "divisible_by_16": launch.divisible_by_16(),
        "registers": usage["REG"],
        "spill_bytes": ptxas["spill_stores"],
        "spill_load_bytes": ptxas["spill_loads"],
        "stack_bytes": ptxas["stack"],
        "shared_bytes": int(kernel.metadata.shared) + usage.get("SHARED", 0),
        "num_warps": int(kernel.metadata.num_warps),
        "num_stages": int(launch.options["num_stages"]),
        "cubin": os.path.relpath(path, out_dir),
        "cases": [],
    }
    return record, (kernel.hash, kernel.name), _kept(kernel.hash, kernel.name, LISTING)


def _described(record: dict, listing: str, out_dir: str) -> dict:
    """`record` with what its SASS listing says, the listing written beside its cubin."""
    path = os.path.join(out_dir, record["cubin"])
    with open(path.replace(".cubin", ".sass"), "w") as f:
        f.write(listing)
    ops = opcodes(listing)
    if not ops:
        raise RuntimeError(f"the SASS listing of {path}: no instructions found")
    return {**record,
            "atomics": sum(op.split(".")[0] in ATOMIC_OPCODES for op in ops),
            "atomic_ops": sorted({op for op in ops if op.split(".")[0] in ATOMIC_OPCODES}),
            "data_atomics": sum(op.split(".")[0] in ATOMIC_OPCODES and op not in ALLOCATOR_ATOMICS for op in ops),
            "tensor_core": tensor_core(ops),
            "tf32": any("MMA" in op and "TF32" in op for op in ops),
            "instructions": len(ops),
            "sass_sha256": hashlib.sha256(sass_body(listing).encode()).hexdigest()}


def compile_launch(launch: Launch, arch: str, out_dir: str) -> dict:
    """Compile `launch` for `arch`, write its cubin and SASS under out_dir/arch, and describe it."""
    record, binary, listing = _compiled(launch, arch, out_dir)
    if listing is None:
        listing = _listings(arch, [(*binary, os.path.join(out_dir, record["cubin"]))])[0]
    return _described(record, listing, out_dir)


def sass_body(sass: str) -> str:
    """The instructions of a SASS listing without the file name line cuobjdump prints first."""
    return "\n".join(line for line in sass.splitlines() if not line.lstrip().startswith("Fatbin")
                     and "code for sm_" not in line and not line.startswith("\t\tFunction"))


def occupancy(record: dict) -> int:
    """Warps of this kernel resident on one SM: limited by registers, shared memory and warps."""
    capability = ARCHS[record["arch"]]
    warps = record["num_warps"]
    # Registers are allocated per warp in units of 256 (8 per thread, rounded up).
    regs_per_warp = -(-record["registers"] * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // (regs_per_warp * warps) if record["registers"] else 10 ** 9
    by_shared = SHARED_PER_SM[capability] // (record["shared_bytes"] + 1024) if record["shared_bytes"] else 10 ** 9
    blocks = min(by_regs, by_shared, MAX_WARPS_PER_SM // warps, 32)
    return blocks * warps


_PENDING: list[tuple[Launch, str, str]] = []


def _compile_pending(i: int) -> tuple[dict, tuple[str, str], str | None]:
    launch, arch, out_dir = _PENDING[i]
    return _compiled(launch, arch, out_dir)


def _listings_of(job: tuple[str, list[tuple[str, str, str]]]) -> list[str]:
    return _listings(*job)


def _shares(items: list[int], sizes: list[int], count: int) -> list[list[int]]:
    """`items` in at most `count` groups of about equal total size, largest first to the lightest."""
    groups: list[list[int]] = [[] for _ in range(min(count, len(items)))]
    totals = [0] * len(groups)
    for i in sorted(items, key=lambda i: -sizes[i]):
        g = totals.index(min(totals))
        groups[g].append(i)
        totals[g] += sizes[i]
    return [g for g in groups if g]


def audit(archs: list[str], out_dir: str, jobs: int = 1, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """One record per kernel x configuration x architecture (see the module docstring), compiled
    by `jobs` processes, then the binaries Triton's cache holds no listing for disassembled by at
    most `jobs` disassembler processes per architecture (tools/sass.py).

    A configuration whose launches needed more than one binary gets one record per binary, all
    with the same `config`: the compile-once tests find them there. `cases` lists the workload
    cases whose launches ran each binary."""
    unique: dict[tuple[str, str], Launch] = {}
    cases: dict[tuple[str, str], list[str]] = {}
    for arch in archs:
        for launch in record(ARCHS[arch]):
            key = (arch, launch.key())
            unique.setdefault(key, launch)
            if launch.case not in cases.setdefault(key, []):
                cases[key].append(launch.case)
    _PENDING[:] = [(launch, arch, out_dir) for (arch, _), launch in unique.items()]
    progress(f"{len(_PENDING)} binaries to compile for {', '.join(archs)} with {jobs} process(es)")
    with contextlib.ExitStack() as stack:
        if jobs > 1:
            import multiprocessing

            # fork: the workers inherit the recorded launches (their JIT functions do not pickle).
            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(jobs))
            mapped = pool.map
        else:
            mapped = map
        compiled = list(mapped(_compile_pending, range(len(_PENDING))))
        listings = [kept for _, _, kept in compiled]
        paths = [os.path.join(out_dir, r["cubin"]) for r, _, _ in compiled]
        sizes = [os.path.getsize(p) for p in paths]
        work = []
        for arch in archs:
            missing = [i for i, (r, _, kept) in enumerate(compiled) if kept is None and r["arch"] == arch]
            for group in _shares(missing, sizes, jobs):
                work.append((group, (arch, [(*compiled[i][1], paths[i]) for i in group])))
        if work:
            progress(f"{sum(len(g) for g, _ in work)} binaries to disassemble in {len(work)} process(es)")
        for (group, _), texts in zip(work, mapped(_listings_of, [job for _, job in work])):
            for i, text in zip(group, texts):
                listings[i] = text
    records = [_described(r, listing, out_dir) for (r, _, _), listing in zip(compiled, listings)]
    for record_, key in zip(records, unique):
        record_["cases"] = cases[key]
    return records


def table(records: list[dict]) -> str:
    """A text table of the records, one line each."""
    lines = [f"{'arch':8} {'kernel':28} {'dtype':6} {'regs':>4} {'spill':>5} {'shared':>7} {'warps':>5} "
             f"{'resident':>8} {'atom':>4} {'mma':8} config"]
    for r in records:
        dtype = next(iter(r["signature"].values())).lstrip("*")
        config = " ".join(f"{k}={v}" for k, v in r["config"].items())
        lines.append(f"{r['arch']:8} {r['kernel']:28} {dtype:6} {r['registers']:4d} {r['spill_bytes']:5d} "
                     f"{r['shared_bytes']:7d} {r['num_warps']:5d} {occupancy(r):8d} {r['atomics']:4d} "
                     f"{r['tensor_core']:8} {config}")
    return "\n".join(lines)


def parse_archs(text: str) -> list[str]:
    archs = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in archs if a not in ARCHS]
    if not archs or bad:
        raise ValueError(f"--arch: expected a comma-separated list of {', '.join(ARCHS)}, got {text!r}")
    return archs


def run(arch: str = ",".join(DEFAULT_ARCHS), out: str = "gpu-audit", json_path: str | None = None,
        jobs: int | None = None, quiet: bool = False) -> int:
    """`lockstep gpu-audit`: audit, print the table and a summary line, write the JSON."""
    archs = parse_archs(arch)
    jobs = jobs or os.cpu_count() or 1
    if jobs < 1:
        raise ValueError(f"--jobs: expected a positive number of processes, got {jobs}")
    progress = (lambda s: None) if quiet else (lambda s: print(f"lockstep gpu-audit: {s}", file=sys.stderr, flush=True))
    records = audit(archs, out, jobs, progress)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
    if not quiet:
        print(table(records))
    atomics = [r for r in records if r["data_atomics"]]
    spills = [r for r in records if r["spill_bytes"]]
    print(f"lockstep gpu-audit: {len(records)} binaries of {len({r['kernel'] for r in records})} kernels for "
          f"{', '.join(archs)}; {len(atomics)} with atomics on data, {len(spills)} with spills; cubins and SASS in {out}")
    return 0

