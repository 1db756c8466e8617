"""Benchmark: cross_entropy against eager PyTorch on this machine (ratios, same run). Usage: python benchmarks/bench_cross_entropy.py [--quick]"""

import sys

from lockstep.tools import bench

if __name__ == "__main__":
    sys.exit(bench.main(["cross_entropy"], quick="--quick" in sys.argv))
