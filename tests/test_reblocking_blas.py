"""The Xeon stand-in of tests/_reblocking_blas.py does what the suite relies on it for: stock GEMMs'
bits follow the thread count and the row count under it, the native backend's do not, and its
sums stay as accurate as the stock ones. It runs in a child process, since it re-registers ATen's
CPU kernels for the whole process."""

import os
import subprocess
import sys

CHILD = r"""
import torch, _reblocking_blas
from lockstep import ops
gen = torch.Generator().manual_seed(0)
x, w = torch.randn(37, 1024, generator=gen), torch.randn(300, 1024, generator=gen)
exact = (x.double() @ w.double().t())
stock = torch.nn.functional.linear(x, w)
_reblocking_blas.install()
torch.set_num_threads(1)
one, native_one = torch.nn.functional.linear(x, w), ops.linear(x, w)
torch.set_num_threads(2)
two, native_two = torch.nn.functional.linear(x, w), ops.linear(x, w)
rows = torch.nn.functional.linear(x[:3], w)
bmm = torch.bmm(x[None], w.t()[None])[0]
err = lambda y: float((y.double() - exact).abs().max())
print("threads_move", not torch.equal(one, two))
print("rows_move", not torch.equal(rows, two[:3]))
print("bmm_reblocked", torch.equal(bmm, two))
print("native_still", torch.equal(native_one, native_two))
print("accurate", err(one) <= 2 * err(stock) and err(two) <= 2 * err(stock))
"""


def test_the_xeon_stand_in_moves_stock_gemm_bits_and_not_the_native_ones():
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    results = dict(line.split() for line in out.stdout.splitlines())
    assert results == {k: "True" for k in ("threads_move", "rows_move", "bmm_reblocked", "native_still", "accurate")}, \
        (results, out.stderr[-2000:])
