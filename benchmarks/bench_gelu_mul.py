"""Benchmark: gelu_mul against eager PyTorch on this machine (ratios, same run). Usage: python benchmarks/bench_gelu_mul.py [--quick]"""

import sys

from lockstep.tools import bench

if __name__ == "__main__":
    sys.exit(bench.main(["gelu_mul"], quick="--quick" in sys.argv))
