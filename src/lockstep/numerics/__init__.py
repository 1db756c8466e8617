"""The fixed-order numerics, lockstep's lowest layer: every reduction order it decides and the
arithmetic whose bits it fixes.

- `fixed_order`: the orders of sums, GEMMs, softmax rows and weight gradients (docs/contract.md,
  section 2), gathered from `tiles`, `rows`, `gemm`, `weight_grad` and `tree`;
- `cpu_kernels`: the sets of CPU kernels that carry that arithmetic, passed to each function as its
  `kernels` argument (None: PyTorch's in fixed tiles; or a backend's own);
- `elementwise`: exp, log, sqrt and SiLU on the kernels passed in;
- `grad_tree`: weight gradients that do not depend on how a training window is split;
- `exact_math`: powers, logs, cos and sin whose bits do not depend on the machine;
- `second_order`: second derivatives refused by name;
- `chunks`: cache-sized chunks for elementwise chains; `softcap`: the logit softcap.
"""
