"""The Xeon stand-in of tests/_reblocking_blas.py (docs/adr/0024) does what the suite relies on it
for: a stock GEMM sums K in the documented blocks, which follow the thread count and the row
count, in every form the portable backend and stock PyTorch call; the native backend's bits stay;
the library's probe of the portable backend's premises sees what the documented arithmetic
breaks, and the row term in the "rows" mode; arguments it does not take reach the stock kernel's
errors. It runs in a child process, since it re-registers ATen's CPU kernels for the whole
process."""

import subprocess
import sys

import pytest

import _reblocking_blas

CHILD = r"""
import sys, torch, _reblocking_blas
from lockstep import ops, registry
from lockstep.numerics import gemm as numerics_gemm
mode = sys.argv[1]
gen = torch.Generator().manual_seed(0)
x, w = torch.randn(37, 1024, generator=gen), torch.randn(300, 1024, generator=gen)
bias = torch.randn(300, generator=gen)

def blocks(a, b, threads):
    # the documented arithmetic, by the stock kernel (before install): K in fp32 blocks, one per
    # thread, one more below 16 rows in the "rows" mode
    torch.set_num_threads(threads)
    parts = threads + (1 if mode == "rows" and a.shape[0] < 16 else 0)
    step = -(-a.shape[1] // parts)
    out = a[:, :step].float() @ b[:step].float()
    for s in range(step, a.shape[1], step):
        out = out + a[:, s:s + step].float() @ b[s:s + step].float()
    return out

expected = {(rows, t): blocks(x[:rows], w.t(), t) for rows in (3, 37) for t in (1, 2)}
torch.set_num_threads(2)
stock_premises = set(numerics_gemm.torch_gemm_broken_premises())  # this machine's MKL's, before install
numerics_gemm._gemm_broken_premises.cache_clear()
# what the probe should see of the documented arithmetic: that of the stock kernel on K's blocks
documented_premises = set(numerics_gemm.gemm_broken_premises(lambda a, b: blocks(a, b, 2)))
# widened before it is sliced, as the stand-in does: the blocks then have the stand-in's strides,
# on which a BLAS may choose its kernel
expected_bf16 = (blocks(x[:5].bfloat16().float(), w.t().bfloat16().float(), 2)
                 + bias.bfloat16().float()).bfloat16()
try:
    _reblocking_blas.install("tbb")
    checks = {"bad_mode_refused": False}
except ValueError as e:
    expected_error = "LOCKSTEP_TEST_REBLOCKING_BLAS: expected one of ['threads', 'rows'], got 'tbb'"
    checks = {"bad_mode_refused": expected_error in str(e)}
_reblocking_blas.install(mode)
for (rows, t), want in expected.items():
    torch.set_num_threads(t)
    checks[f"mm_rows{rows}_threads{t}"] = torch.equal(x[:rows] @ w.t(), want)
    out = torch.empty(0)
    checks[f"mm_out_rows{rows}_threads{t}"] = torch.equal(torch.mm(x[:rows], w.t(), out=out), want)
checks["blocks_follow_threads"] = not torch.equal(expected[(37, 1)], expected[(37, 2)])
bf16_linear = torch.nn.functional.linear(x[:5].bfloat16(), w.bfloat16(), bias.bfloat16())
checks["bf16_bias_rounded_once"] = torch.equal(bf16_linear, expected_bf16)
moved = {}
for backend in ("portable", "native"):
    with registry.use_backend(backend):
        runs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = ops.linear(xg, wg)
            y.square().sum().backward()
            runs.append((y.detach(), xg.grad, wg.grad))
    moved[backend] = [not torch.equal(a, b) for a, b in zip(*runs)]
checks["portable_moves"] = all(moved["portable"])
# the library's probe of the portable backend's premises sees what the documented arithmetic
# breaks, the row term included. Not "stock's premises and the row term": the stock kernel's
# verdicts at a block of K need not be its verdicts at the whole K (on a Xeon, MKL's blocking
# follows the shape), and the stand-in runs the stock kernel on blocks.
torch.set_num_threads(2)
seen = set(numerics_gemm.torch_gemm_broken_premises())
print("premises: stock", sorted(stock_premises), "documented", sorted(documented_premises),
      "under the stand-in", sorted(seen), file=sys.stderr)
checks["probe_sees_the_documented_arithmetic"] = seen == documented_premises
checks["probe_sees_the_row_term"] = mode != "rows" or "row tiles" in seen
checks["native_stays"] = not any(moved["native"])
try:
    torch.mm(torch.randn(5, 48), torch.randn(100, 7))
    checks["bad_shapes_refused"] = False
except RuntimeError:
    checks["bad_shapes_refused"] = True
ones = lambda *shape: torch.ones(*shape, dtype=torch.long)
checks["integers_stock"] = torch.equal(torch.addmm(ones(2, 2), ones(2, 3), ones(3, 2), beta=2),
                                       torch.full((2, 2), 5, dtype=torch.long))
for name, ok in checks.items():
    print(name, ok)
"""


@pytest.mark.parametrize("mode", ["threads", "rows"])
def test_the_xeon_stand_in_reblocks_stock_gemms_and_not_the_native_ones(mode):
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         env=_reblocking_blas.child_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = dict(line.split() for line in out.stdout.splitlines())
    failed = [name for name, ok in results.items() if ok != "True"]
    assert len(results) == 17 and not failed, (failed, out.stderr[-2000:])
