"""Benchmark: log_softmax against eager PyTorch on this machine (ratios, same run). Usage: python benchmarks/bench_log_softmax.py [--quick]"""

import sys

from lockstep.tools import bench

if __name__ == "__main__":
    sys.exit(bench.main(["log_softmax"], quick="--quick" in sys.argv))
