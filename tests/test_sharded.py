"""The optimizer sharded over the data-parallel ranks (ZeRO stage 1; docs/adr/0037): its partition,
the bits of the unsharded run at DP 2 and DP 2 x TP 2, resume across sharded and unsharded runs
and data-parallel sizes, the state each rank holds, and the errors. Ranks are spawned on gloo."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lockstep import dist as ldist
from lockstep import train
from lockstep.model import ModelConfig, Transformer
from lockstep.train import PackedDataset, SingleProcessSync, TrainConfig, Trainer
from lockstep.train.sharded import Piece, ShardedAdamW, partition

from test_layout import _digest

SEQ_LEN, STEPS = 32, 3
DTYPES = {"fp32": (torch.float32, False), "bf16-master": (torch.bfloat16, True), "bf16": (torch.bfloat16, False)}


# ------------------------------------------------------------------------------------------------
# The partition
# ------------------------------------------------------------------------------------------------
def test_the_partition_gives_every_element_to_one_rank_in_contiguous_ranges():
    shapes = [("b", (3, 5)), ("a", (7,)), ("c", (2, 2, 2)), ("d", (1,))]
    for ranks in (1, 2, 3, 4, 7, 40):
        owned = partition(shapes, ranks)
        assert len(owned) == ranks
        flat = [(pc.name, i) for pieces in owned for pc in pieces for i in range(pc.start, pc.stop)]
        # Every element once, in the flattened order of the parameters sorted by name.
        assert flat == [(n, i) for n, s in sorted(shapes) for i in range(torch.Size(s).numel())]
        width = -(-31 // ranks)
        assert [sum(pc.numel for pc in pieces) for pieces in owned] == \
            [max(0, min(31, (r + 1) * width) - r * width) for r in range(ranks)]
    assert partition(shapes, 2) == [[Piece("a", 0, 7), Piece("b", 0, 9)],
                                    [Piece("b", 9, 15), Piece("c", 0, 8), Piece("d", 0, 1)]]
    assert partition(list(reversed(shapes)), 2) == partition(shapes, 2)      # the parameters' names order them
    with pytest.raises(ValueError, match=r"ranks: expected a positive int, got 0"):
        partition(shapes, 0)


# ------------------------------------------------------------------------------------------------
# The bits of the unsharded run
# ------------------------------------------------------------------------------------------------
def _tokens() -> list[int]:
    return torch.randint(0, 300, (6000,), generator=torch.Generator().manual_seed(0)).tolist()


def _train(dtype_name: str, mb: int, accum: int, shard: bool = False, tp: int = 0) -> dict:
    """STEPS steps with weight decay and clipping on (tp 0: one process): per step the loss, the
    gradient norm and digests of the parameters and the optimizer state after it; the state's
    bytes on this rank."""
    dtype, master = DTYPES[dtype_name]
    cfg = TrainConfig(steps=STEPS, seq_len=SEQ_LEN, micro_batch_tokens=mb, accum=accum, lr=3e-3, warmup=1,
                      weight_decay=0.1, grad_clip=0.5, master_weights=master, shard_optimizer=shard)
    config = ModelConfig.tiny("qwen3", vocab_size=300, num_heads=4, num_kv_heads=2)
    model = Transformer.from_config(config, seed=0, dtype=dtype)
    sync = None
    if tp:
        ldist.initialize_model_parallel(tp)
        if tp > 1:
            ldist.tensor_parallel(model)
        sync = ldist.ParallelSync(model)
    trainer = Trainer(model, PackedDataset(_tokens(), SEQ_LEN, mb, 0), cfg, sync)
    steps = []
    for _ in range(STEPS):
        rec = trainer.step()
        params, state = trainer.full_state()
        steps.append([rec["loss"], rec["grad_norm"], _digest(params), _digest(state) if state else None])
    return {"steps": steps, "sharded": trainer.sharded, "state_bytes": trainer.optimizer_state_bytes()}


# (name, tp, micro_batch_tokens, accum, dtype): 8 sequences a step at every data-parallel size.
SHARDED_RUNS = {2: [("dp2-mb64x2", 1, 64, 2, "fp32"), ("dp2-mb128x1", 1, 128, 1, "fp32"),
                    ("dp2-mb64x2", 1, 64, 2, "bf16-master"), ("dp2-mb128x1", 1, 128, 1, "bf16")],
                4: [("dp2-tp2-mb64x2", 2, 64, 2, "bf16-master")]}


def _sharded_worker(rank, world, out):
    results = {f"{dtype}/{name}": _train(dtype, mb, accum, True, tp)
               for name, tp, mb, accum, dtype in SHARDED_RUNS[world]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def references():
    return {dtype: _train(dtype, 256, 1) for dtype in {run[-1] for runs in SHARDED_RUNS.values() for run in runs}}


@pytest.mark.parametrize("world", [2, 4])
def test_the_sharded_optimizer_trains_the_bits_of_the_unsharded_one(world, tmp_path, references):
    ldist.spawn(_sharded_worker, world, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]
    for name, tp, *_, dtype in SHARDED_RUNS[world]:
        ref = references[dtype]
        writer = ranks[0][f"{dtype}/{name}"]
        assert writer["sharded"] and writer["steps"] == ref["steps"], (dtype, name)
        dp_rank0 = {r for r in range(world) if r < tp}          # the ranks the state is gathered to
        for r, got in enumerate(ranks):
            run = got[f"{dtype}/{name}"]
            # Every rank holds the parameters' bits; the whole state reaches data-parallel rank 0.
            assert [s[:3] for s in run["steps"]] == [s[:3] for s in ref["steps"]], (dtype, name, r)
            assert all((s[3] is not None) == (r in dp_rank0) for s in run["steps"]), (dtype, name, r)
        if tp == 1:
            # Two data-parallel ranks hold the whole state between them: half each, to an element.
            held = [got[f"{dtype}/{name}"]["state_bytes"] for got in ranks]
            assert sum(held) == ref["state_bytes"] and abs(held[0] - held[1]) <= 3 * 8, (dtype, name, held)


# ------------------------------------------------------------------------------------------------
# Resume across sharded and unsharded runs and data-parallel sizes
# ------------------------------------------------------------------------------------------------
def _cfg(steps: int, mb: int, shard: bool) -> TrainConfig:
    # A constant learning rate after warmup: the schedule does not depend on `steps`.
    return TrainConfig(steps=steps, seq_len=32, micro_batch_tokens=mb, lr=3e-3, warmup=1, min_lr_ratio=1.0,
                       weight_decay=0.1, master_weights=True, save_every=2, shard_optimizer=shard)


def _run_worker(rank, world, data, out, steps, mb, shard, resume, tp):
    train.run("tiny", data, out, _cfg(steps, mb, shard), dtype=torch.bfloat16, resume=resume, progress=False,
              tensor_parallel=tp)


def _run(world, data, out, steps, mb, shard, resume=False, tp=1):
    if world == 1:
        train.run("tiny", data, out, _cfg(steps, mb, shard), dtype=torch.bfloat16, resume=resume, progress=False)
    else:
        ldist.spawn(_run_worker, world, data, out, steps, mb, shard, resume, tp)


def _files(out, step) -> list[bytes]:
    return [(out / f"step-{step:06d}" / f).read_bytes() for f in ("model.safetensors", "optimizer.safetensors")]


def _steps(out) -> list:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in train.read_log(str(out))[0]]


def test_resume_crosses_sharded_and_unsharded_runs_and_data_and_tensor_parallel_sizes(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("the cat sat on the mat, and the dog sat on the log. " * 80)
    whole, a, b = tmp_path / "whole", tmp_path / "a", tmp_path / "b"
    _run(1, str(data), str(whole), 4, 128, False)
    _run(2, str(data), str(a), 2, 64, True)                         # sharded at DP 2 ...
    assert _files(a, 2) == _files(whole, 2)                         # ... writes the unsharded checkpoint
    _run(1, str(data), str(a), 4, 128, False, resume=True)          # ... resumes unsharded at DP 1
    _run(2, str(data), str(b), 2, 128, False, tp=2)                 # unsharded at TP 2 ...
    _run(2, str(data), str(b), 4, 64, True, resume=True)            # ... resumes sharded at DP 2
    for out in (a, b):
        assert _steps(out) == _steps(whole)
        assert _files(out, 4) == _files(whole, 4)
    events = train.read_log(str(a))[1]
    assert events[0]["layout"]["shard_optimizer"] is True and "shard_optimizer" not in events[1]["layout"]
    assert events[1]["changes"]["shard_optimizer"] == [True, False]
    changes = train.read_log(str(b))[1][1]["changes"]
    assert changes["shard_optimizer"] == [False, True]
    assert [layout["tensor_parallel"] for layout in changes["layout"]] == [2, 1], changes["layout"]


# ------------------------------------------------------------------------------------------------
# Errors and the one-rank case
# ------------------------------------------------------------------------------------------------
def _tiny() -> Transformer:
    return Transformer.from_config(ModelConfig.tiny("llama", vocab_size=300), seed=0)


def test_shard_optimizer_must_be_a_bool():
    with pytest.raises(ValueError, match=r"shard_optimizer: expected True or False, got 'yes'"):
        TrainConfig(shard_optimizer="yes").validate()


def test_a_sync_without_data_parallel_collectives_is_refused_by_name():
    class TwoRanks(SingleProcessSync):
        dp_size = 2

    with pytest.raises(TypeError, match=r"shard_optimizer: the sync \(TwoRanks\) has no all_gather_shards; "
                                        r"sharding the optimizer needs lockstep.dist.ParallelSync"):
        Trainer(_tiny(), None, TrainConfig(shard_optimizer=True), TwoRanks())


def test_one_data_parallel_rank_has_nothing_to_shard(tmp_path, capsys):
    """At one rank the partition gives it every element: the optimizer is the unsharded one, and
    the start message says so."""
    trainer = Trainer(_tiny(), None, TrainConfig(shard_optimizer=True))
    assert not trainer.sharded and "shard_optimizer" not in trainer.layout
    assert not isinstance(trainer.opt, ShardedAdamW)
    data = tmp_path / "d.txt"
    data.write_text("the cat sat on the mat. " * 40)
    train.run("tiny", str(data), str(tmp_path / "out"), TrainConfig(steps=1, seq_len=32, micro_batch_tokens=64,
                                                                     shard_optimizer=True), progress=False)
    assert ("shard_optimizer: one data-parallel rank, nothing to shard (it holds the whole optimizer state)"
            in capsys.readouterr().err)


def test_the_cli_takes_shard_optimizer():
    from lockstep.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["train", "--data", "d", "--out", "o", "--shard-optimizer"]).shard_optimizer
    assert not parser.parse_args(["train", "--data", "d", "--out", "o"]).shard_optimizer
    assert parser.parse_args(["rl", "--out", "o", "--shard-optimizer"]).shard_optimizer
