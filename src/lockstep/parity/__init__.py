"""lockstep.parity: find where two runs stop computing the same bits.

- `Recorder` records every op call of a forward and backward pass through a hook in the op
  registry, so it records the same thing whether the caller is the model, the engine or the
  trainer. A forward record holds the op's output. A backward record holds the gradient the op
  sends to each of its float inputs. Each record has the module path (`model.layers.3.mlp.down_proj`),
  the op name, the call index, shapes, dtype, a digest of the bits, max |x|, a float64 norm and,
  optionally, the tensor.
- `compare` aligns two recordings op by op and reports the first op whose bits differ, forward
  and then backward, with the max abs and max ULP difference, the number of differing elements,
  and the ops after it that it contaminated. A `RowView` restricts a recording to one sequence,
  so "alone vs in a batch of 8" compares like with like.
- `compare_trajectories` runs two trainers side by side and reports loss, gradient norm and
  parameter norm per step, and the first step that leaves the contract. When both trainers are
  lockstep trainers, it also reports the first diverging op of that step, from the same pre-step
  state.

    recorder      Recorder, RowView
    compare       compare, format_comparison, ulp_distance
    runs          RunConfig, record_run, parity (`lockstep parity`)
    trajectories  compare_trajectories, PlainTrainer (`lockstep parity --trajectory`)
"""

from .compare import Comparison, Divergence, compare, format_comparison, ulp_distance
from .recorder import OpRecord, Recorder, RowView
from .runs import MAX_BATCH, RunConfig, parity, record_run
from .trajectories import (
    UNIT_TREE_BACKENDS,
    PlainTrainer,
    compare_trajectories,
    format_trajectory,
    trajectory_on_random_tokens,
)

__all__ = ["MAX_BATCH", "UNIT_TREE_BACKENDS", "Comparison", "Divergence", "OpRecord", "PlainTrainer", "Recorder", "RowView",
           "RunConfig", "compare", "compare_trajectories", "format_comparison", "format_trajectory", "parity", "record_run",
           "trajectory_on_random_tokens", "ulp_distance"]
