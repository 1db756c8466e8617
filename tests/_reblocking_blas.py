"""A stand-in for MKL on an Intel Xeon (docs/adr/0024), for running the suite on any machine.

On an Intel Xeon, MKL sums an fp32 GEMM's K in blocks that follow the thread count (and, under
MKL_ENABLE_INSTRUCTIONS, the row count), so a product's bits change with both. On the AMD machines
the suite usually runs on, MKL keeps one order across thread counts, and a test that leans on that
passes there and fails on a Xeon. With LOCKSTEP_TEST_REBLOCKING_BLAS=threads (a Xeon's MKL) or
=rows (the row count too, MKL_ENABLE_INSTRUCTIONS's case), conftest installs this module: every
floating-point GEMM that reaches ATen's CPU kernels (mm, addmm, bmm, baddbmm,
addbmm, mv, addmv, dot, vdot, their out= and in-place forms, and _grouped_mm's expert form) sums
K in k_block's blocks (one per thread), each block by the stock kernel on operands widened to fp32
(fp64 stays fp64), the blocks added in order, a bias added in the same precision and the result
rounded once. So the suite shows on any machine what depends on the BLAS keeping its order: the
portable backend, the float64 reference and stock PyTorch reach these ops; lockstep's native
kernels never do (tests/test_native_audit.py audits that). Arguments the stand-in does not take (other
dtypes, mismatched shapes) go to the stock kernel, which accepts or refuses them as usual.
"""

from __future__ import annotations

import os
import threading

import torch

MODES = ("threads", "rows")
_libs: list = []
_inside = threading.local()
_follow_rows = False


def k_block(k: int, rows: int) -> int:
    """How many of K's terms one block sums: K split into one block per thread, and one block more
    below 16 output rows in the "rows" mode. At one thread (and 16 rows or more) that is one block,
    the stock kernel's own order, so the stock kernel's other dependences (on the row count, on
    this machine's MKL) stay, and the thread count adds its own."""
    parts = torch.get_num_threads() + (1 if _follow_rows and rows < 16 else 0)
    return max(1, -(-k // parts))


def _takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.is_floating_point() and not a.is_complex() and a.dtype == b.dtype
            and a.dim() == b.dim() and a.shape[-1] == b.shape[-2] and a.shape[:-2] == b.shape[:-2])


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] in the accumulation dtype: K's blocks by the stock kernel
    (mm or bmm), added in order."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    aw, bw, step = a.to(acc), b.to(acc), k_block(a.shape[-1], a.shape[-2])
    out = torch.matmul(aw[..., :step], bw[..., :step, :])
    for s in range(step, a.shape[-1], step):
        out += torch.matmul(aw[..., s:s + step], bw[..., s:s + step, :])
    return out


def _scaled_sum(bias: torch.Tensor, product: torch.Tensor, beta, alpha, dtype) -> torch.Tensor | None:
    """beta * bias + alpha * product in the accumulation dtype, rounded once; beta = 0 ignores the
    bias (NaN included), as BLAS does. None (the stock kernel's answer) for a bias that does not
    broadcast to the product."""
    try:
        if torch.broadcast_shapes(bias.shape, product.shape) != product.shape:
            return None
    except RuntimeError:
        return None
    out = product if alpha == 1 else product * alpha
    if beta != 0:
        out = out + (bias.to(out.dtype) if beta == 1 else bias.to(out.dtype) * beta)
    return out.to(dtype)


def _mm(a, b):
    return _product(a, b).to(a.dtype) if _takes(a, b) and a.dim() == 2 else None


def _bmm(a, b):
    return _product(a, b).to(a.dtype) if _takes(a, b) and a.dim() == 3 else None


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if not (_takes(a, b) and a.dim() == 2 and bias.dtype == a.dtype):
        return None
    return _scaled_sum(bias, _product(a, b), beta, alpha, a.dtype)


def _baddbmm(bias, a, b, *, beta=1, alpha=1):
    if not (_takes(a, b) and a.dim() == 3 and bias.dtype == a.dtype):
        return None
    return _scaled_sum(bias, _product(a, b), beta, alpha, a.dtype)


def _addbmm(bias, a, b, *, beta=1, alpha=1):
    """The batch entries' products summed: one product over the batch and K together."""
    if not (_takes(a, b) and a.dim() == 3 and bias.dtype == a.dtype):
        return None
    rows = a.permute(1, 0, 2).reshape(a.shape[1], -1)
    return _scaled_sum(bias, _product(rows, b.reshape(-1, b.shape[2])), beta, alpha, a.dtype)


def _mv(a, v):
    return _mm(a, v[:, None])[:, 0] if v.dim() == 1 and _takes(a, v[:, None]) else None


def _addmv(bias, a, v, *, beta=1, alpha=1):
    if not (v.dim() == 1 and _takes(a, v[:, None]) and bias.dtype == a.dtype):
        return None
    return _scaled_sum(bias, _product(a, v[:, None])[:, 0], beta, alpha, a.dtype)


def _dot(a, b):
    if not (a.dim() == 1 and b.dim() == 1 and _takes(a[None], b[:, None])):
        return None
    return _product(a[None], b[:, None])[0, 0].to(a.dtype)


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """The experts' form only: rows [S, K] in groups ending at offs [G], weights [G, K, N]."""
    if offs is None or bias is not None or a.dim() != 2 or b.dim() != 3 or not _takes(a[None], b[:1]):
        return None
    dtype = out_dtype or a.dtype
    out = a.new_zeros((a.shape[0], b.shape[2]), dtype=dtype)
    start = 0
    for g, stop in enumerate(offs.tolist()):
        if stop > start:
            out[start:stop] = _product(a[start:stop], b[g]).to(dtype)
        start = stop
    return out


# The out= and in-place forms as lockstep.mode.kernels builds its own, except that an `out` of
# another dtype or an in-place result of another shape goes to the stock kernel, which refuses it.
def _out_form(fn):
    def out_kernel(*args, out, **kwargs):
        result = fn(*args, **kwargs)
        if result is None or result.dtype != out.dtype:
            return None
        if out.shape != result.shape:
            out.resize_(result.shape)
        return out.copy_(result)
    return out_kernel


def _inplace_form(fn):
    def inplace_kernel(self, *args, **kwargs):
        result = fn(self, *args, **kwargs)
        return None if result is None or result.shape != self.shape else self.copy_(result)
    return inplace_kernel


_GEMMS = {"mm": _mm, "bmm": _bmm, "addmm": _addmm, "baddbmm": _baddbmm, "addbmm": _addbmm, "mv": _mv,
          "addmv": _addmv, "dot": _dot, "vdot": _dot}
KERNELS = {**_GEMMS, **{f"{name}.out": _out_form(fn) for name, fn in _GEMMS.items()},
           **{f"{name}_": _inplace_form(fn) for name, fn in _GEMMS.items()
              if name.startswith("add") or name == "baddbmm"},
           "_grouped_mm": _grouped_mm}


def _kernel(fn, stock):
    def kernel(keyset, *args, **kwargs):
        if getattr(_inside, "active", False):
            return stock.call_boxed(keyset, *args, **kwargs)
        _inside.active = True       # the stand-in's own GEMMs (its blocks) run the stock kernels
        try:
            out = fn(*args, **kwargs)
        finally:
            _inside.active = False
        return stock.call_boxed(keyset, *args, **kwargs) if out is None else out
    return kernel


def child_env() -> dict[str, str]:
    """The environment of a child process that installs the stand-in itself: the tests folder on
    its path, and conftest's variable unset so that nothing installs it twice."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCKSTEP_TEST_REBLOCKING_BLAS", None)
    return env


def install(mode: str = "threads") -> None:
    """Register the re-blocking kernels on the CPU dispatch key for the rest of the process; mode
    "threads" or "rows" (see the module docstring)."""
    global _follow_rows
    if mode not in MODES:
        raise ValueError(f"LOCKSTEP_TEST_REBLOCKING_BLAS: expected one of {list(MODES)}, got {mode!r}")
    _follow_rows = mode == "rows"
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in KERNELS.items():
        try:
            stock = torch.library.get_kernel(f"aten::{name}", "CPU")
        except (RuntimeError, AttributeError):
            continue                # not in this torch build, or composite (it decomposes into the others)
        lib.impl(name, _kernel(fn, stock), "CPU", with_keyset=True)
    _libs.append(lib)
