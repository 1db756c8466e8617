"""Benchmark: attention against scaled_dot_product_attention (ratios, same run). Usage: python benchmarks/bench_attention.py [--quick]"""

import sys

from lockstep.tools import bench

if __name__ == "__main__":
    sys.exit(bench.main(["attention"], quick="--quick" in sys.argv))
