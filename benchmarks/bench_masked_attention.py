"""Benchmark: masked_attention against scaled_dot_product_attention with the same boolean mask
(ratios, same run). Usage: python benchmarks/bench_masked_attention.py [--quick]"""

import sys

from lockstep.tools import bench

if __name__ == "__main__":
    sys.exit(bench.main(["masked_attention"], quick="--quick" in sys.argv))
