"""Benchmark: vocab_logprobs against eager PyTorch on this machine (ratios, same run). Usage: python benchmarks/bench_vocab_logprobs.py [--quick]"""

import sys

from lockstep.tools import bench

if __name__ == "__main__":
    sys.exit(bench.main(["vocab_logprobs"], quick="--quick" in sys.argv))
