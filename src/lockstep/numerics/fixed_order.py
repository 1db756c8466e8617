"""Fixed-order building blocks: every reduction order lockstep decides, in one place.

The portable and native backends, the batch-invariant mode, the trainer and the harness take their
reductions from here; the Triton backend shares the block sizes and the loss reductions. The order
of floating-point additions depends only on the reduced length, never on how many rows share the
call, their order, the memory layout or the thread count (docs/contract.md, section 2):

- `row_sum` (`rows`): a sum over the last dimension built only from elementwise adds, in a shape
  that depends on the row length alone; with it log_softmax's rows and the LM head's chunked
  log-sum-exp.
- `matmul_rows` (`gemm`): a GEMM whose row dimension is cut into fixed-shape tiles, so the BLAS sees
  the same problem shape whatever the batch size (docs/adr/0001-fixed-tiles-and-reduction-order.md),
  or the GEMM of the CPU kernels passed in (`lockstep.numerics.cpu_kernels`).
- `weight_grad` and `column_sum` (`weight_grad`): the order in which weight gradients reduce over
  rows, in fixed blocks of `ROW_BLOCK` rows added in block order.
- `TreeSum` and `tree_sum` (`tree`): the one tree by which partial sums over an index combine,
  wherever the parts were computed.
- `exp`, `log`, `sqrt` and `silu` (`elementwise`): the elementwise math these orders run on.

Each function with a kernel form takes the CPU kernels it runs on as its `kernels` argument (None:
PyTorch's). This module gathers those names; each is defined in the module named beside it.
"""

from __future__ import annotations

import importlib
import warnings

from .elementwise import exp, log, rsqrt, silu, silu_backward, silu_backward_composed, silu_composed, sqrt
from .gemm import gemm_broken_premises, matmul_rows, split_matmul_rows, torch_gemm_broken_premises, torch_matmul_rows
from .rows import (lse_fold, log_softmax_rows, log_softmax_rows_backward, logit_grad, row_max, row_sum,
                   scaled_logits, shifted_and_lse)
from .tiles import (COLUMN_CHUNK, CPU_BF16_TAIL_TILES, KEY_BLOCK, ROW_BLOCK, ROW_TILE, SUM_WIDTH, TAIL_TILE,
                    TAIL_TILES, TP_SPLIT, accumulate_dtype, ceil_div, tail_tiles)
from .tree import TreeSum, pieces_of, split_sum, tree_node_into, tree_sum
from .weight_grad import (CHUNK_LEAVES, LEAF_ROWS, LM_HEAD_ROW_BLOCK, column_sum, lm_head_weight_grad, padded_block,
                          pairwise_weight_grad, reduce_losses, row_scale, sum_over_rows, torch_weight_grad,
                          weight_grad, weight_grad_node)

# The CPU-kernel selection lived here; its names now come from lockstep.numerics.cpu_kernels.
_SELECTION = ("CpuKernels", "register_cpu_kernels", "current_cpu_kernels", "cpu_kernels", "records_cpu_kernels",
              "restores_cpu_kernels", "columns_at_any_width")


def __getattr__(name: str):
    if name in _SELECTION:
        warnings.warn(f"lockstep.numerics.fixed_order.{name} has moved to lockstep.numerics.cpu_kernels",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(".cpu_kernels", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "exp", "log", "rsqrt", "silu", "silu_backward", "silu_backward_composed", "silu_composed", "sqrt",
    "gemm_broken_premises", "matmul_rows", "split_matmul_rows", "torch_gemm_broken_premises", "torch_matmul_rows",
    "lse_fold", "log_softmax_rows", "log_softmax_rows_backward", "logit_grad", "row_max", "row_sum", "scaled_logits",
    "shifted_and_lse",
    "COLUMN_CHUNK", "CPU_BF16_TAIL_TILES", "KEY_BLOCK", "ROW_BLOCK", "ROW_TILE", "SUM_WIDTH", "TAIL_TILE",
    "TAIL_TILES", "TP_SPLIT", "accumulate_dtype", "ceil_div", "tail_tiles",
    "TreeSum", "pieces_of", "split_sum", "tree_node_into", "tree_sum",
    "CHUNK_LEAVES", "LEAF_ROWS", "LM_HEAD_ROW_BLOCK", "column_sum", "lm_head_weight_grad", "padded_block",
    "pairwise_weight_grad", "reduce_losses", "row_scale", "sum_over_rows", "torch_weight_grad", "weight_grad",
    "weight_grad_node",
]
