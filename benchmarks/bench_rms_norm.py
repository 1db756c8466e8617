"""Benchmark: rms_norm against eager PyTorch on this machine (ratios, same run). Usage: python benchmarks/bench_rms_norm.py [--quick]"""

import sys

from lockstep.tools import bench

if __name__ == "__main__":
    sys.exit(bench.main(["rms_norm"], quick="--quick" in sys.argv))
