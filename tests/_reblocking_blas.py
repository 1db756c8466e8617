"""A stand-in for MKL on an Intel Xeon (issue 27), for running the suite on any machine.

On an Intel Xeon, MKL sums an fp32 GEMM's K in blocks that follow the thread count (and, under
MKL_ENABLE_INSTRUCTIONS, the row count), so a product's bits change with both. On the AMD machines
the suite usually runs on, MKL keeps one order, and a test that leans on the BLAS's order passes
there and fails on a Xeon. With LOCKSTEP_TEST_REBLOCKING_BLAS=1, conftest installs this module:
every CPU GEMM that reaches ATen's stock kernels (mm, addmm, bmm, baddbmm, mv, addmv, dot) sums K
in blocks of 16 x threads rows, 8 more below 16 output rows, each block by the stock kernel on
operands widened to fp32 (fp64 stays fp64), so the suite shows on any machine what depends on the
BLAS keeping its order. lockstep's native kernels never reach these ops (tests/test_native.py
audits that); the portable backend, the float64 reference and stock PyTorch do.
"""

from __future__ import annotations

import torch

_libs: list = []


def k_block(rows: int) -> int:
    """How many of K's terms one block sums, as a Xeon's MKL would choose differently per threads."""
    return 16 * torch.get_num_threads() + (8 if rows < 16 else 0)


def _reblocked(product, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] as fp32 (fp64) partial products over K's blocks, added in order."""
    k = a.shape[-1]
    if k == 0 or not a.is_floating_point():
        return product(a, b)
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    aw, bw, step = a.to(acc), b.to(acc), k_block(a.shape[-2])
    out = product(aw[..., :step], bw[..., :step, :])
    for s in range(step, k, step):
        out = out + product(aw[..., s:s + step], bw[..., s:s + step, :])
    return out.to(torch.result_type(a, b))


def install() -> None:
    """Register the reblocking kernels on the CPU dispatch key for the rest of the process."""
    lib = torch.library.Library("aten", "IMPL")
    stock = {name: torch.library.get_kernel(f"aten::{name}", "CPU")
             for name in ("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot")}

    def call(name, keyset):
        return lambda *args: stock[name].call_boxed(keyset, *args)

    def mm(keyset, a, b):
        return _reblocked(call("mm", keyset), a, b)

    def bmm(keyset, a, b):
        return _reblocked(call("bmm", keyset), a, b)

    def addmm(keyset, bias, a, b, *, beta=1, alpha=1):
        if not a.is_floating_point():
            return call("addmm", keyset)(bias, a, b, beta=beta, alpha=alpha)
        return _scaled_sum(bias, _reblocked(call("mm", keyset), a, b), beta, alpha)

    def baddbmm(keyset, bias, a, b, *, beta=1, alpha=1):
        if not a.is_floating_point():
            return call("baddbmm", keyset)(bias, a, b, beta=beta, alpha=alpha)
        return _scaled_sum(bias, _reblocked(call("bmm", keyset), a, b), beta, alpha)

    def mv(keyset, a, v):
        return _reblocked(call("mm", keyset), a, v[:, None])[:, 0]

    def addmv(keyset, bias, a, v, *, beta=1, alpha=1):
        return _scaled_sum(bias, _reblocked(call("mm", keyset), a, v[:, None])[:, 0], beta, alpha)

    def dot(keyset, a, b):
        return _reblocked(call("mm", keyset), a[None], b[:, None])[0, 0]

    for name, fn in (("mm", mm), ("bmm", bmm), ("addmm", addmm), ("baddbmm", baddbmm), ("mv", mv),
                     ("addmv", addmv), ("dot", dot)):
        lib.impl(name, fn, "CPU", with_keyset=True)
    _libs.append(lib)


def _scaled_sum(bias: torch.Tensor, product: torch.Tensor, beta, alpha) -> torch.Tensor:
    """beta * bias + alpha * product, with beta = 0 ignoring bias (NaN included) as BLAS does."""
    out = product if alpha == 1 else product * alpha
    if beta == 0:
        return out.clone() if out is product else out
    return out + (bias if beta == 1 else bias * beta)
