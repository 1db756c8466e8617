"""lockstep gpu-audit: every Triton kernel compiled to sm_80, sm_90a and sm_100a machine code on this
CPU, and the machine code held to the contract (docs/gpu.md).

The audit runs once per session, as a user runs it (`lockstep gpu-audit` in a process of its own:
the Triton backend must be imported with TRITON_INTERPRET=0, and this process imports it under
the interpreter): conftest.py's `gpu_audit_output`. A serial run starts it once the tests are
collected, at the lowest priority, and runs the tests that read it last, so that on a fresh
machine its compiles use the time the rest of the suite leaves a core idle; under xdist the
fixture starts it, once per worker that runs one of these tests (so .ci/cpu-suite runs them in a
serial pytest of their own). The checks that show the audit's detectors can fail compile planted
kernels in another subprocess.
"""

from __future__ import annotations

import collections
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap


ARCHS = ("sm_80", "sm_90a", "sm_100a")
TRITON_BIN = os.path.join(os.path.dirname(importlib.util.find_spec("triton").origin), "backends", "nvidia", "bin")
SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024, "sm_100a": 227 * 1024}
# Bytes of spill stores (ptxas -v's static count) that a binary may have, by class: today's worst on
# any architecture rounded up to a multiple of 1,024 (docs/gpu.md, "Spills"; ADR 0030). Only
# attention spills, most at head dim 128 and in the backward's dK/dV kernel. 16-bit attention is the
# serving path (worst 1,460, sm_90a's dK/dV); fp32 attention is the accuracy reference (worst
# 23,800, its dK/dV at head dim 128, which ptxas gives 32 registers). fp32 at sm_90a's 64 query rows
# had up to 63,516, which is why fp32 keeps 16 rows there.
SPILL_CEILING = {"other": 0, "16-bit attention": 2 * 1024, "fp32 attention": 24 * 1024}
# Every kernel the Triton backend defines (a new one must be launched by the audit's workload).
KERNELS = {"gemm_kernel", "partial_colsum_kernel", "rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "rope_kernel",
           "silu_mul_fwd_kernel", "silu_mul_bwd_kernel", "gelu_mul_fwd_kernel", "gelu_mul_bwd_kernel",
           "embedding_fwd_kernel", "embedding_bwd_kernel", "log_softmax_fwd_kernel", "log_softmax_bwd_kernel",
           "cross_entropy_fwd_kernel", "cross_entropy_bwd_kernel", "lse_update_kernel", "dlogits_kernel",
           "attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel", "attn_masked_fwd_kernel",
           "attn_masked_bwd_dq_kernel", "attn_masked_bwd_dkdv_kernel", "gemm_group_kernel", "add_rms_norm_fwd_kernel",
           "rope_kv_kernel"}


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def _dtype(record):
    return next(t for t in record["signature"].values() if t.startswith("*")).lstrip("*")


def test_every_kernel_on_every_arch_with_its_files(gpu_audit_output):
    out, records, stdout = gpu_audit_output
    fields = {"kernel", "arch", "config", "registers", "spill_bytes", "spill_load_bytes", "stack_bytes",
              "shared_bytes", "num_warps", "atomics", "tensor_core", "sass_sha256", "cubin"}
    for r in records:
        assert fields <= set(r), f"missing fields {fields - set(r)}"
        assert (out / r["cubin"]).is_file() and (out / r["cubin"].replace(".cubin", ".sass")).is_file()
        assert r["registers"] > 0 and r["num_warps"] in (1, 2, 4, 8, 16)
    for arch in ARCHS:
        assert {r["kernel"] for r in records if r["arch"] == arch} == KERNELS, arch
        # every dtype of the contract, fp32 and both 16-bit types, reaches the GEMM
        assert {_dtype(r) for r in records if r["arch"] == arch and r["kernel"] == "gemm_kernel"} >= \
            {"fp32", "bf16", "fp16"}
    assert f"{len(records)} binaries of {len(KERNELS)} kernels" in stdout
    for line in stdout.splitlines()[1:4]:
        assert line.split()[0] in ARCHS


def test_no_atomics_on_data(gpu_audit_output):
    _, records, _ = gpu_audit_output
    for r in records:
        assert r["data_atomics"] == 0, (r["kernel"], r["arch"], r["config"], r["atomic_ops"])
        if r["arch"] != "sm_100a":
            assert r["atomics"] == 0, (r["kernel"], r["arch"], r["atomic_ops"])
        # sm_100's MMA claims tensor memory with shared-memory bit operations (docs/gpu.md)
        assert set(r["atomic_ops"]) <= {"ATOMS.OR", "ATOMS.AND"}


def _spill_class(record) -> str:
    if not record["kernel"].startswith("attn_"):
        return "other"
    return "fp32 attention" if _dtype(record) == "fp32" else "16-bit attention"


def test_spills_within_their_ceilings_and_shared_memory_within_the_block_limit(gpu_audit_output):
    """Spill stores as ptxas counts them stay under SPILL_CEILING, and no block asks for more
    shared memory than its architecture gives one."""
    _, records, _ = gpu_audit_output
    for r in records:
        assert r["spill_bytes"] <= SPILL_CEILING[_spill_class(r)], \
            (r["kernel"], r["arch"], r["config"], r["spill_bytes"])
        assert r["shared_bytes"] <= SHARED_LIMIT[r["arch"]], (r["kernel"], r["arch"], r["config"], r["shared_bytes"])


def test_fp32_kernels_use_no_reduced_precision_mma(gpu_audit_output):
    _, records, _ = gpu_audit_output
    fp32 = [r for r in records if r["config"].get("PRECISION") == "ieee"]
    assert {r["kernel"] for r in fp32} >= {"gemm_kernel", "attn_fwd_kernel", "attn_bwd_dq_kernel"}
    for r in fp32:
        assert _dtype(r) == "fp32"
        assert r["tensor_core"] == "none" and not r["tf32"], (r["kernel"], r["arch"], r["tensor_core"])
    # and the 16-bit GEMM does run on the tensor cores, each generation with its own instruction
    for arch, family in (("sm_80", "HMMA"), ("sm_90a", "HGMMA"), ("sm_100a", "UTCHMMA")):
        gemm16 = [r for r in records if r["arch"] == arch and r["kernel"] == "gemm_kernel" and _dtype(r) == "bf16"]
        assert gemm16 and all(family in r["tensor_core"].split("+") for r in gemm16), arch


def test_compile_once_across_sizes(gpu_audit_output):
    """One binary per kernel configuration, although the workload ran every size argument at
    several values: rows 1, 7, 16 and 4096; 1, 3 and 8 sequences of many lengths; vocabularies
    of 3000, 49152 and 151936. Triton specializes pointers and the GEMM's strides (ADR 0014),
    which follow a model's sizes and layouts; it never specializes a size."""
    _, records, _ = gpu_audit_output
    binaries = collections.defaultdict(list)
    for r in records:
        specialized = r["divisible_by_16"] + [k for k in r["config"] if not k.isupper()]
        assert all(r["signature"].get(k, "").startswith("*") or k.startswith("stride") for k in specialized), \
            (r["kernel"], specialized)
        # Every pointer 16-byte aligned, the engine's step metadata at every batch size included:
        # an alignment that followed the batch would compile a second binary mid-run.
        assert {k for k, t in r["signature"].items() if t.startswith("*")} <= set(r["divisible_by_16"]), \
            (r["kernel"], r["cases"][:2], r["divisible_by_16"])
        binaries[(r["kernel"], r["arch"], json.dumps(r["signature"], sort_keys=True),
                  json.dumps(r["config"], sort_keys=True), tuple(r["divisible_by_16"]))].append(r["sass_sha256"])
    assert all(len(v) == 1 for v in binaries.values()), [k for k, v in binaries.items() if len(v) > 1]

    def sizes_seen(kernel, arch, dtype, pattern):
        return {case.split(pattern)[1].split()[0] for r in records if r["kernel"] == kernel and r["arch"] == arch
                and _dtype(r) == dtype for case in r["cases"] if pattern in case}

    for arch in ARCHS:
        gemm = [r for r in records if r["kernel"] == "gemm_kernel" and r["arch"] == arch and _dtype(r) == "bf16"
                and not r["config"]["HAS_BIAS"] and r["signature"]["c_ptr"] == "*bf16"]
        rows = {case.split("rows=")[1] for r in gemm for case in r["cases"] if "rows=" in case}
        assert {"1", "7", "16", "4096"} <= rows
        assert sizes_seen("attn_fwd_kernel", arch, "bf16", "seqs=") == {"1", "3", "8"}
        assert sizes_seen("attn_masked_fwd_kernel", arch, "bf16", "seqs=") == {"1", "3", "8"}
        assert sizes_seen("lse_update_kernel", arch, "fp32", "vocab=") >= {"49152", "151936"}


def test_the_gemm_pipelines_its_loads(gpu_audit_output):
    """ADR 0014: with K unit-strided in both operands (linear's forward, x @ W^T), the GEMM's K
    loop copies its tiles with 16-byte cp.async (LDGSTS), several stages deep; before the strides
    were specialized it loaded 2-byte scalars, one stage deep. So does the grouped GEMM of the
    engine's projections, whose tiles are the GEMM's."""
    out, records, _ = gpu_audit_output
    for arch, kernel in itertools.product(("sm_80", "sm_90a"), ("gemm_kernel", "gemm_group_kernel")):
        forward = [r for r in records if r["kernel"] == kernel and r["arch"] == arch
                   and r["config"].get("stride_ak") == 1 and r["config"].get("stride_bk") == 1]
        assert {_dtype(r) for r in forward} >= {"fp32", "bf16", "fp16"}, (arch, kernel)
        for r in forward:
            sass = (out / r["cubin"].replace(".cubin", ".sass")).read_text()
            assert re.search(r"LDGSTS[.\w]*\.128\b", sass), (arch, r["config"])
            assert r["num_stages"] >= 3


def instructions(listing: str) -> list[str]:
    """A SASS listing's instruction and encoding lines, spacing aside (the column of the encodings
    follows the widest instruction in the disassembler's input)."""
    return [" ".join(line.split()) for line in listing.splitlines() if re.match(r"\s+/\*( 0x|[0-9a-f]{4,}\*/)", line)]


def test_one_disassembler_lists_each_binary_as_cuobjdump_does(gpu_audit_output):
    """The audit disassembles many binaries of one architecture in one nvdisasm process
    (tools/sass.py): the largest and smallest binary of each architecture, and a GEMM, list the
    instructions, addresses, branch targets and encodings that cuobjdump gives the cubin alone."""
    out, records, _ = gpu_audit_output
    for arch in ARCHS:
        mine = sorted((r for r in records if r["arch"] == arch), key=lambda r: (out / r["cubin"]).stat().st_size)
        gemm = next(r for r in mine if r["kernel"] == "gemm_kernel")
        for r in {id(r): r for r in (mine[0], mine[-1], gemm)}.values():
            cubin = out / r["cubin"]
            alone = subprocess.run([os.path.join(TRITON_BIN, "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                                   text=True, check=True).stdout
            listed = instructions(cubin.with_suffix(".sass").read_text())
            assert listed and listed == instructions(alone), (arch, r["kernel"], r["cubin"])


PLANTED = textwrap.dedent("""
    import json, os, re, sys
    from lockstep.tools import gpu_audit
    import torch, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.cache import get_cache_manager

    def instructions(listing):
        return [" ".join(line.split()) for line in listing.splitlines()
                if re.match(r"\\s+/\\*( 0x|[0-9a-f]{4,}\\*/)", line)]

    @triton.jit
    def specialized(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    @triton.jit(do_not_specialize=["n"])
    def unspecialized(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    @triton.jit
    def atomic(x_ptr, y_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.atomic_add(y_ptr, tl.sum(tl.load(x_ptr + i), axis=0))

    @triton.jit
    def hoarder(x_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i)
        tl.store(x_ptr + i, x - tl.sum(x, axis=0))    # every element stays live across the sum

    out = {}
    with gpu_audit.recording(90) as (launches, case):
        for n in (1, 7, 16, 4096):
            x = torch.zeros(n)
            specialized[(1,)](x, n, BLOCK=64)
            unspecialized[(1,)](x, n, BLOCK=64)
        atomic[(1,)](torch.zeros(64), torch.zeros(1), BLOCK=64)
        for block in (1024, 16384):                   # 32 and 512 elements per thread of one warp
            hoarder[(1,)](torch.zeros(block), BLOCK=block, num_warps=1)
        from lockstep.backends.triton import gemm
        gemm.gemm(torch.zeros(8, 64), torch.zeros(64, 32))
    for name in ("specialized", "unspecialized"):
        ls = [l for l in launches if l.kernel == name]
        out[name] = [len({l.key() for l in ls}),
                     len({gpu_audit.compile_launch(l, "sm_90a", sys.argv[1])["sass_sha256"] for l in ls})]
    atom = next(l for l in launches if l.kernel == "atomic")
    out["atomic"] = gpu_audit.compile_launch(atom, "sm_90a", sys.argv[1])["data_atomics"]
    listings, disassembled = gpu_audit.sass.listings, []
    gpu_audit.sass.listings = lambda *args: disassembled.append(args) or listings(*args)
    again = gpu_audit.compile_launch(atom, "sm_90a", sys.argv[1])
    gpu_audit.sass.listings = listings
    cubin = sys.argv[1] + "/" + again["cubin"]
    kept = open(cubin.replace(".cubin", ".sass")).read()
    out["sass_kept"] = [len(disassembled), instructions(kept) == instructions(gpu_audit._tool("cuobjdump", "-sass", cubin))]
    fp32 = next(l for l in launches if l.kernel == "gemm_kernel")
    names = list(fp32.signature)
    fp32.constexprs = {p: ("tf32" if names[p[0]] == "PRECISION" else v) for p, v in fp32.constexprs.items()}
    tf32 = gpu_audit.compile_launch(fp32, "sm_80", sys.argv[1])
    out["tf32"] = [tf32["tf32"], tf32["tensor_core"]]
    hoarders = [l for l in launches if l.kernel == "hoarder"]
    out["spills"] = [gpu_audit.compile_launch(l, "sm_90a", sys.argv[1])["spill_bytes"] for l in hoarders]

    # Audited again, the spilling kernel's figures come from the ptxas report kept in Triton's cache;
    # with that report gone, the binary is compiled once more (forced past the cache), and kept again.
    compile, compiles = triton.compile, []
    def counted(*args, **kwargs):
        compiles.append("forced" if triton.knobs.compilation.always_compile else "cached")
        return compile(*args, **kwargs)
    triton.compile = counted
    spilled = hoarders[1]
    figures = lambda r: [r["spill_bytes"], r["spill_load_bytes"], r["stack_bytes"]]
    seen = []
    for drop_report in (False, True, False):
        if drop_report:
            kernel = compile(ASTSource(spilled.fn, spilled.signature, spilled.constexprs, spilled.attrs),
                             target=GPUTarget("cuda", 90, 32), options=dict(spilled.options))
            os.remove(get_cache_manager(kernel.hash).get_file("hoarder.ptxas"))
        compiles.clear()
        record = gpu_audit.compile_launch(spilled, "sm_90a", sys.argv[1])
        seen.append([figures(record), list(compiles)])
    out["ptxas_kept"] = seen
    print(json.dumps(out))
""")


def test_the_detectors_catch_planted_faults(tmp_path):
    """The checks above can fail: a size that Triton specializes on gives several binaries, an
    atomic add is counted, an fp32 GEMM asked for TF32 is flagged, and a kernel that keeps 512
    values per thread live spills. A binary audited again is neither disassembled nor compiled
    again, the SASS kept for it lists cuobjdump's instructions, and one whose kept ptxas report is
    gone is compiled once more, with the same figures."""
    script = tmp_path / "planted.py"             # Triton reads a kernel's source from its file
    script.write_text(PLANTED)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=_env(),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    keys, binaries = out["specialized"]
    assert keys == 3 and binaries >= 2          # n == 1 (a constant), n % 16 == 0, and the rest
    assert out["unspecialized"] == [1, 1]
    assert out["atomic"] >= 1
    assert out["sass_kept"] == [0, True]        # the second audit of a binary reads its SASS from Triton's cache
    assert out["tf32"] == [True, "HMMA"]
    in_registers, spilled = out["spills"]       # from ptxas's report: cuobjdump's resource usage has no spills
    assert in_registers == 0 and spilled > 0
    (kept, one_compile), (recompiled, two_compiles), (kept_again, one_again) = out["ptxas_kept"]
    assert one_compile == ["cached"] and two_compiles == ["cached", "forced"] and one_again == ["cached"]
    assert kept == recompiled == kept_again and kept[0] == spilled


def test_bad_arch_is_a_clear_error():
    done = subprocess.run([sys.executable, "-m", "lockstep.cli", "gpu-audit", "--arch", "sm_75"], capture_output=True,
                          text=True, env=_env(), timeout=120)
    assert done.returncode == 2
    assert "--arch: expected a comma-separated list of sm_80, sm_90a, sm_100a, got 'sm_75'" in done.stderr


DOT_FORM = textwrap.dedent('''
    import json
    import os
    import re

    os.environ["TRITON_INTERPRET"] = "0"            # compile for the GPU target, as the audit does

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lockstep.backends.triton import gemm

    def dot_accumulates_in_place(dtype):
        """Whether the K loop's dot accumulates into the running tile rather than from a zero
        constant (TTGIR)."""
        kernel = gemm.gemm_kernel
        ptr = "*fp32" if dtype == "fp32" else "*bf16"
        sig = {name: (ptr if name.endswith("_ptr") else "i32") for name in kernel.arg_names}
        const = dict(HAS_BIAS=False, ACCUMULATE=False, PRECISION="ieee" if dtype == "fp32" else "tf32",
                     EVEN_M=False, EVEN_N=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=16 if dtype == "fp32" else 64)
        sig.update({k: "constexpr" for k in const})
        src = ASTSource(fn=kernel, signature=sig,
                        constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()})
        ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ttgir"]
        zeros = set(re.findall(r"(%[\\w.]+) = arith.constant dense<0.000000e\\+00>", ttgir))
        accs = re.findall(r"= (?:tt|ttng)\\.(?:dot|warp_group_dot) %[\\w.]+, %[\\w.]+, (%[\\w.]+)", ttgir)
        assert accs, ttgir[-2000:]
        return any(acc not in zeros for acc in accs)

    print(json.dumps({d: dot_accumulates_in_place(d) for d in ("fp32", "bf16")}))
''')


def test_the_fp32_gemm_adds_each_partial_product(tmp_path):
    """ADR 0013: the fp32 dot starts each K step from zero and is then added to the tile (Triton's
    combine pass would otherwise fold the add into one FMA chain over all of K); the bf16 dot
    accumulates in place, which shows that the check tells the two forms apart."""
    script = tmp_path / "dot_form.py"
    script.write_text(DOT_FORM)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"fp32": False, "bf16": True}
