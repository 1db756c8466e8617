"""lockstep.dist: data and tensor parallelism on torch.distributed, with the bits of one process.

No sum across ranks is left to a collective's own order. Every rank computes the pieces of the
canonical tree (lockstep.numerics.fixed_order.TreeSum) that its share covers, and the ranks complete the
same tree, so the result is bitwise what one process computes, at every data- and tensor-parallel
size (docs/contract.md, section 5; docs/adr/0007).

- Data parallel (`ParallelSync.complete`): each rank holds a contiguous run of the window's units and
  its unit trees hold that run's pieces. When the pieces are one level of the tree, two-rank
  all_reduces complete it level by level; otherwise the pieces are cut into one shard per rank, the
  owner of a shard receives every rank's pieces of it (all_to_all), completes the tree and the
  completed shards are all-gathered.
- Tensor parallel: Megatron-style column- and row-parallel linears. Attention heads and the MLP are
  split across ranks. Every reduction the split shards runs in `TP_SPLIT` parts at every size
  (the model's split_k and split_n); a rank computes its run of parts and `tree_all_reduce`
  completes the tree across the ranks.

    launch           torchrun's environment, `spawn` (tests and tools), timeouts
    collectives      tree_all_reduce, all_equal, check_consistent, from_rank0
    tensor_parallel  the Megatron-style API and `tensor_parallel(model)`
    data_parallel    ParallelSync: the Trainer's GradientSync across ranks
"""

from .collectives import RankZeroFailed, all_equal, check_consistent, from_rank0, group_size, tree_all_reduce
from .data_parallel import ParallelSync, share_of
from .launch import DEFAULT_TIMEOUT_S, RankFailed, free_port, init_from_env, spawn
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    head_norms,
    initialize_model_parallel,
    model_parallel_groups,
    reduction_parts,
    tensor_parallel,
    tensor_parallel_size,
)

__all__ = ["DEFAULT_TIMEOUT_S", "ColumnParallelLinear", "ParallelSync", "RankFailed", "RankZeroFailed",
           "RowParallelLinear", "VocabParallelEmbedding", "all_equal", "check_consistent", "free_port", "from_rank0",
           "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "group_size", "head_norms",
           "init_from_env", "initialize_model_parallel", "model_parallel_groups", "reduction_parts", "share_of", "spawn",
           "tensor_parallel", "tensor_parallel_size", "tree_all_reduce"]
