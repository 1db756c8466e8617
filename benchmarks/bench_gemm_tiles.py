"""The Triton GEMM's tile configurations on this GPU, against cuBLAS in the same process (needs CUDA).

For each candidate (BLOCK_M x BLOCK_N x BLOCK_K, warps, stages) and each shape: the median time,
TFLOP/s and the ratio to `x @ w.t()` (ratio > 1: lockstep slower), and whether the tile keeps the
contract's row invariance on this device (rows 0..6 of the 2048-row product == the 7-row product
== the 1-row product's row 0, bit for bit). The first candidate is the one GEMM_CONFIGS holds now.

    python benchmarks/bench_gemm_tiles.py [--dtype bf16|fp32] [--json PATH]
"""

import sys

import torch

from lockstep.backends.triton.common import GemmConfig, gemm_config
from lockstep.backends.triton.gemm import gemm

from bench_gpu import bench as median_ms, write_json

CANDIDATES = {
    torch.bfloat16: [None, GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 256, 64, 8, 3), GemmConfig(128, 128, 64, 8, 4),
                     GemmConfig(64, 256, 64, 4, 3), GemmConfig(128, 64, 64, 4, 3)],
    torch.float32: [None, GemmConfig(64, 64, 32, 4, 3), GemmConfig(128, 128, 16, 8, 3), GemmConfig(64, 128, 16, 4, 3),
                    GemmConfig(128, 128, 32, 8, 3)],
}
SHAPES = [(1, 4096, 4096), (128, 4096, 4096), (2048, 4096, 4096), (8192, 4096, 4096), (2048, 14336, 4096),
          (1, 4096, 14336)]


def row_invariant(cfg: GemmConfig, dtype: torch.dtype) -> bool:
    w = torch.randn(1024, 4096, device="cuda", dtype=dtype)
    x = torch.randn(2048, 4096, device="cuda", dtype=dtype)
    big, seven, one = (gemm(x[:m], w.t(), config=cfg) for m in (2048, 7, 1))
    return torch.equal(big[:7], seven) and torch.equal(seven[:1], one)


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_gemm_tiles: no CUDA device; nothing measured")
        return 1
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[sys.argv.index("--dtype") + 1]
                                                             if "--dtype" in sys.argv else "bf16"]
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, {dtype}")
    print("| tile (M x N x K, warps, stages) | M, N, K | lockstep ms | TFLOP/s | cuBLAS ms | ratio | rows invariant |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for cfg in CANDIDATES[dtype]:
        cfg = cfg or gemm_config(dtype)
        try:
            invariant = row_invariant(cfg, dtype)
        except Exception as e:  # a tile that does not fit this GPU (shared memory) is reported, not fatal
            print(f"| {tuple(cfg)} | - | failed: {type(e).__name__}: {str(e)[:80]} | | | | |")
            continue
        for m, n, k in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
            ours = median_ms(lambda: gemm(x, w.t(), config=cfg))
            ref = median_ms(lambda: x @ w.t())
            tflops = 2 * m * n * k / ours / 1e9
            rows.append(dict(config=list(cfg), m=m, n=n, k=k, ms=ours, cublas_ms=ref, invariant=invariant))
            print(f"| {cfg.block_m}x{cfg.block_n}x{cfg.block_k}, {cfg.num_warps}, {cfg.num_stages} | {m}, {n}, {k} | "
                  f"{ours:.3f} | {tflops:.0f} | {ref:.3f} | {ours / ref:.2f} | {invariant} |", flush=True)
    write_json(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
