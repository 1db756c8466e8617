"""Benchmark: rope against eager PyTorch on this machine (ratios, same run). Usage: python benchmarks/bench_rope.py [--quick]"""

import sys

from lockstep.tools import bench

if __name__ == "__main__":
    sys.exit(bench.main(["rope"], quick="--quick" in sys.argv))
