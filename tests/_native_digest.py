"""Print the native backend's digests (lockstep.tools.backend_bits), for tests/test_native_bits.py.

One digest per section (an op in a dtype, training, ...) per thread count (1, 2, 3) of one process;
the instruction set and the BLAS selections come from the environment, which the kernel libraries
read once, so the test starts a fresh process for each. Beside them, for the same thread counts,
the bits of a stock fp32 `F.linear` at the issue's shape (37 x 1024 by 3072 x 1024): where its BLAS
re-blocks with the thread count, those differ.

    python tests/_native_digest.py   ->   {"isa": "avx512", "pool": "openmp", "aten": "AVX512",
                                          "compiler": "gcc (Debian 12.2.0-14) 12.2.0",
                                          "digests": {"1": {"training": "...", ...}, ...},
                                          "stock_linear": {"1": "...", ...}}

    python tests/_native_digest.py --threads 2   the same for those thread counts alone

    python tests/_native_digest.py --small ...   the same of SMALL, a smaller workload of the same
                                                 sections, for an emulated CPU and this one alike,
                                                 without the stock `F.linear` unless --stock-linear

    python tests/_native_digest.py --record   writes this machine's bits, the whole backend's and
                                              the kernels' (lockstep.backends.native.bits), into
                                              that package's recorded_bits.json (ADR 0026); under
                                              another torch release that gives the recorded bits,
                                              adds that release to the file's list, and refuses one
                                              that gives other bits (--replace records them)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from dataclasses import replace

from lockstep.tools.backend_bits import SIZES, Workload, digests, release
from lockstep.backends.native.build import compiler, compiler_version, isa_name, pool_name


# Every section, op, dtype and code path of the recorded workload, with less arithmetic: where TCG
# runs the scalar path one helper call an element, the GEMMs' multiply-adds are most of the time.
# 16 rows still put the GEMMs of linear and the LM head, and the LM head's row kernels, over the
# threshold of one thread; attention keeps its lengths, which cross its 64-key blocks. The trained
# model keeps its layers, heads and grouped queries, narrower, on micro-batches of two sequences.
# The rotary tables keep positions up to 2^20, fewer of them.
SMALL = Workload(sizes=replace(SIZES, pool=16), trained=(("hidden_size", 32), ("intermediate_size", 64),
                                                          ("head_dim", 8)),
                 micro_batch_tokens=64, rope_step=9973)


def stock_linear() -> str:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 1024, generator=gen), torch.randn(3072, 1024, generator=gen)
    return hashlib.sha256(torch.nn.functional.linear(x, w).view(torch.uint8).numpy().tobytes()).hexdigest()


ABOUT = ("The native backend's bits, the same on every machine: `lockstep check` compares this machine's kernels "
         "and whole native backend with them, and so does tests/test_native_bits.py. `torch` lists the releases under "
         "which the whole backend gave these bits. After a change that alters them on purpose, rerun `python "
         "tests/_native_digest.py --record` under a listed release and say why in the commit; run it under another "
         "release to add that release where it gives these bits (docs/adr/0026).")


def measure() -> dict:
    """This machine's bits in recorded_bits.json's form: the torch-free digest of every kernel (one
    thread count and instruction set stand for all: tests/test_native_bits.py ties them) and the whole
    backend's sections on 1 thread, with what they were computed on and this torch release."""
    import numpy as np

    from lockstep.backends.native import bits, build
    from lockstep.tools.bench import cpu_name

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"about": ABOUT,
                "recorded_on": {"machine": cpu_name(), "isa": isa_name(),
                                "aten": torch.backends.cpu.get_cpu_capability(),
                                "compiler": compiler_version(compiler()).split("\n")[0], "numpy": np.__version__},
                "torch": [release(torch.__version__)],
                "kernels": bits.digests(build.library(), build.isa(), 1),
                "native_backend": digests()}
    finally:
        torch.set_num_threads(threads)


def _releases(value: object) -> list[str]:
    """A recording's `torch` as a list of releases: a list, or one version string (the first form)."""
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return [release(r) for r in items if isinstance(r, str)]


def _by_version(releases: set[str]) -> list[str]:
    return sorted(releases, key=lambda r: ([int(p) if p.isdigit() else -1 for p in r.split(".")], r))


def merge(previous: dict | None, now: dict, replace: bool = False) -> tuple[dict, list[str]]:
    """The file to write, given the file as it was (`previous`, None for none) and this machine's
    bits (`now`, from measure()), and the releases it no longer lists. Where the bits are the ones
    recorded, this release joins the list and the machine named stays. Where they changed under a
    listed release (a change to the arithmetic), `now` is recorded and the other releases are
    dropped, since nothing has shown that they give the new bits. Where they differ under a release
    the file does not list, the release itself may be why (its generators draw other inputs), so
    this raises ValueError unless `replace`."""
    if not previous:
        return now, []
    earlier, (this,) = _releases(previous.get("torch")), now["torch"]
    if (previous.get("kernels"), previous.get("native_backend")) == (now["kernels"], now["native_backend"]):
        return {**now, **previous, "about": now["about"], "torch": _by_version({*earlier, this})}, []
    if earlier and this not in earlier and not replace:
        from lockstep.backends.native import bits

        kernels = bits.differing(now["kernels"], previous.get("kernels", {}))
        sections = bits.differing(now["native_backend"], previous.get("native_backend", {}))
        why = (f"the kernels differ ({', '.join(kernels)}), which no torch release touches: the arithmetic changed"
               if kernels else f"the whole backend differs in {', '.join(sections)}, and another release's "
                               "generators may draw other inputs")
        raise ValueError(f"torch {this} is not among the recording's releases (torch {', '.join(earlier)}) and gives "
                         f"other bits: {why}. After a change to the arithmetic, record under a listed release; "
                         "--replace records these bits and drops the listed releases")
    return now, [r for r in earlier if r != this]


def main() -> int:
    args = sys.argv[1:]
    if args in (["--record"], ["--record", "--replace"]):
        # The clone's file, which the commit carries, whichever lockstep this interpreter imports.
        recorded = Path(__file__).resolve().parent.parent / "src/lockstep/backends/native/recorded_bits.json"
        try:
            previous = json.loads(recorded.read_text())
        except (OSError, ValueError) as e:
            print(f"could not read {recorded} ({e}): writing a new recording")
            previous = None
        try:
            data, dropped = merge(previous if isinstance(previous, dict) else None, measure(), "--replace" in args)
        except ValueError as e:
            print(f"not recorded: {e}", file=sys.stderr)
            return 1
        recorded.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote {recorded}: the bits under torch {', '.join(data['torch'])}, recorded on "
              f"{data['recorded_on']['machine']}")
        if dropped:
            print(f"the bits changed, so the file no longer lists torch {', '.join(dropped)}: run --record under "
                  f"{'each' if len(dropped) > 1 else 'it'} to add {'them' if len(dropped) > 1 else 'it'} back where "
                  "the new bits hold")
        return 0
    counts, work = (1, 2, 3), SMALL if "--small" in args else None
    with_stock = not work or "--stock-linear" in args
    args = [a for a in args if a not in ("--small", "--stock-linear")]
    if len(args) == 2 and args[0] == "--threads" and all(n.isdigit() and int(n) > 0 for n in args[1].split(",")):
        counts, args = tuple(int(n) for n in args[1].split(",")), []
    if args:
        raise SystemExit(f"usage: python {sys.argv[0]} [--record [--replace] | [--small [--stock-linear]] "
                         f"[--threads N[,N...]]]; "
                         f"got {args}")
    out, stock = {}, {}
    for threads in counts:
        torch.set_num_threads(threads)
        out[str(threads)] = digests(work) if work else digests()
        if with_stock:
            stock[str(threads)] = stock_linear()
    print(json.dumps({"isa": isa_name(), "pool": pool_name(), "aten": torch.backends.cpu.get_cpu_capability(),
                      "compiler": compiler_version(compiler()).split("\n")[0], "digests": out,
                      "stock_linear": stock}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
