"""Distributed tests on CPU with gloo: spawned processes write their results to files."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from lockstep import contract, train
from lockstep import dist as ldist
from lockstep.model import ModelConfig, Transformer, logprobs
from lockstep.train import PackedDataset, TrainConfig, Trainer

CFG = dict(steps=4, seq_len=24, micro_batch_tokens=48, accum=1, lr=3e-3, warmup=1)


def _tokens():
    return torch.randint(0, 300, (5000,), generator=torch.Generator().manual_seed(0)).tolist()


def _model(seed=0, **kw):
    return Transformer.from_config(ModelConfig.tiny("qwen3", vocab_size=300, num_heads=8, num_kv_heads=4,
                                                    intermediate_size=192, **kw), seed=seed)


def _trainer(accum=1, model=None):
    cfg = TrainConfig(**{**CFG, "accum": accum})
    return Trainer(model or _model(), PackedDataset(_tokens(), cfg.seq_len, cfg.micro_batch_tokens, 0), cfg)


def _write(path, rank, data):
    with open(os.path.join(path, f"rank{rank}.json"), "w") as f:
        json.dump(data, f)


def _read(path, world):
    return [json.load(open(os.path.join(path, f"rank{r}.json"))) for r in range(world)]


def _dp_worker(rank, world, out, steps, resume_dir, save_at):
    dp = ldist.DataParallelTrainer(_trainer())
    if resume_dir and not save_at:
        dp.resume(resume_dir)
    rec = {"losses": [], "identical": [], "compared": []}
    for i in range(steps):
        rec["losses"].append(dp.step()["loss"])
        same, n = dp.params_identical()
        rec["identical"].append(same)
        rec["compared"].append(n)
        if save_at and i + 1 == save_at:
            dp.save(resume_dir)
    rec["hash"] = dp.t.params_hash()
    _write(out, rank, rec)


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_promises(world, tmp_path):
    ldist.spawn(_dp_worker, world, str(tmp_path), 3, None, 0)
    results = _read(tmp_path, world)
    for r in results:
        assert all(r["identical"]) and r["compared"] == [world] * 3        # promise 1, and it ran
        assert r["hash"] == results[0]["hash"] and r["losses"] == results[0]["losses"]
    single = _trainer(accum=world)                                           # promise 2
    losses = [single.step()["loss"] for _ in range(3)]
    assert losses == results[0]["losses"]
    assert single.params_hash() == results[0]["hash"]


def test_data_parallel_checkpoint_resume_is_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    ldist.spawn(_dp_worker, 2, str(tmp_path), 4, str(ckpt), 2)
    uninterrupted = _read(tmp_path, 2)[0]
    (tmp_path / "resumed").mkdir()
    ldist.spawn(_dp_worker, 2, str(tmp_path / "resumed"), 2, str(ckpt), 0)
    resumed = _read(tmp_path / "resumed", 2)[0]
    assert resumed["losses"] == uninterrupted["losses"][2:]
    assert resumed["hash"] == uninterrupted["hash"]


def _tp_worker(rank, world, out, tp, dtype_name):
    dtype = getattr(torch, dtype_name)
    ldist.initialize_model_parallel(tp)
    model = ldist.tensor_parallel(_model().to(dtype))
    seqs = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (17, 5, 30)]
    lp = logprobs(model, seqs)
    again = logprobs(model, seqs)
    flat = torch.cat(lp).detach()
    same_ranks, n = ldist.all_equal(flat, ldist.get_tensor_model_parallel_group())
    torch.cat(lp).sum().backward()
    norm_grad = model.model.layers[0].input_layernorm.weight.grad
    grads_same, _ = ldist.all_equal(norm_grad, ldist.get_tensor_model_parallel_group())
    _write(out, rank, {"lp": flat.float().tolist(), "same_ranks": same_ranks, "compared": n,
                       "repeat": torch.equal(flat, torch.cat(again).detach()), "grads_same": grads_same,
                       "tp_rank": ldist.get_tensor_model_parallel_rank(),
                       "tp_size": ldist.get_tensor_model_parallel_world_size()})


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_model(tp, tmp_path):
    ldist.spawn(_tp_worker, tp, str(tmp_path), tp, "float32")
    results = _read(tmp_path, tp)
    seqs = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (17, 5, 30)]
    ref = torch.cat(logprobs(_model(), seqs)).detach()
    for r in results:
        assert r["same_ranks"] and r["compared"] == tp and r["repeat"] and r["grads_same"]
        assert r["tp_size"] == tp
        assert float((torch.tensor(r["lp"]) - ref).abs().max()) <= contract.chain_tolerance(torch.float32)
    assert sorted(r["tp_rank"] for r in results) == list(range(tp))


def _tp_ckpt_worker(rank, world, out, ckpt, steps, save_at, resume):
    ldist.initialize_model_parallel(world)
    trainer = _trainer(model=ldist.tensor_parallel(_model()))
    cfg_clip = trainer.cfg.grad_clip
    assert cfg_clip > 0
    if resume:
        ldist.resume_checkpoint(trainer, ckpt)
    losses = []
    for i in range(steps):
        losses.append(trainer.step()["loss"])
        if save_at and i + 1 == save_at:
            ldist.save_checkpoint(trainer, ckpt)
    norm_w = trainer.model.model.layers[0].input_layernorm.weight
    replicated_same, _ = ldist.all_equal(norm_w.detach(), ldist.get_tensor_model_parallel_group())
    _write(out, rank, {"losses": losses, "hash": trainer.params_hash(), "replicated_same": replicated_same})


def test_tensor_parallel_checkpoint_resume_is_bitwise(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "full").mkdir()
    (tmp_path / "resumed").mkdir()
    ldist.spawn(_tp_ckpt_worker, 2, str(tmp_path / "full"), ckpt, 4, 2, False)
    ldist.spawn(_tp_ckpt_worker, 2, str(tmp_path / "resumed"), ckpt, 2, 0, True)
    full, resumed = _read(tmp_path / "full", 2), _read(tmp_path / "resumed", 2)
    for r in range(2):
        assert full[r]["replicated_same"] and resumed[r]["replicated_same"]     # one clip norm on every rank
        assert resumed[r]["losses"] == full[r]["losses"][2:]
        assert resumed[r]["hash"] == full[r]["hash"]
    assert full[0]["losses"] == full[1]["losses"]


def _dp_tp_worker(rank, world, out):
    ldist.initialize_model_parallel(2)
    model = ldist.tensor_parallel(_model())
    trainer = _trainer(model=model)
    dp = ldist.DataParallelTrainer(trainer, group=ldist.get_data_parallel_group())
    losses, identical = [], []
    for _ in range(2):
        losses.append(dp.step()["loss"])
        identical.append(dp.params_identical()[0])
    norm_w = trainer.model.model.layers[0].input_layernorm.weight.detach()
    replicated_same, _ = ldist.all_equal(norm_w, ldist.get_tensor_model_parallel_group())
    _write(out, rank, {"losses": losses, "identical": identical, "hash": trainer.params_hash(),
                       "replicated_same": replicated_same})


def test_data_and_tensor_parallel_together(tmp_path):
    ldist.spawn(_dp_tp_worker, 4, str(tmp_path))
    r = _read(tmp_path, 4)
    assert all(all(x["identical"]) for x in r)
    assert r[0]["hash"] == r[2]["hash"] and r[1]["hash"] == r[3]["hash"]     # DP replicas of a TP shard
    assert r[0]["losses"] == r[1]["losses"] == r[2]["losses"] == r[3]["losses"]
    assert all(x["replicated_same"] for x in r)


def _failing_worker(rank, world):
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")
    dist.barrier()                   # rank 0 would wait here forever without the fault handling
    time.sleep(60)


def test_a_failing_rank_ends_the_job_without_hanging():
    started = time.time()
    with pytest.raises(ldist.RankFailed, match="(?s)rank 1 of 2 failed.*ValueError: rank 1 failed on purpose"):
        ldist.spawn(_failing_worker, 2, timeout_s=30)
    assert time.time() - started < 45


def _mismatch_worker(rank, world):
    ldist.DataParallelTrainer(_trainer(model=_model(seed=rank)))


def test_ranks_with_different_parameters_are_refused():
    with pytest.raises(Exception, match="different initial parameters"):
        ldist.spawn(_mismatch_worker, 2, timeout_s=30)


def test_initialize_model_parallel_bad_size(tmp_path):
    with pytest.raises(Exception, match="tensor_model_parallel_size: expected a divisor of the world size 2"):
        ldist.spawn(_bad_tp_worker, 2, timeout_s=30)


def _bad_tp_worker(rank, world):
    ldist.initialize_model_parallel(3)


def test_torchrun_launches_training(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("abc def ghi " * 500)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = tmp_path / "run"
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(ldist.free_port()), "-m",
                           "lockstep", "train", "--data", str(data), "--steps", "3", "--seq-len", "32",
                           "--micro-batch-tokens", "64", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log, events = train.read_log(str(out))
    assert len(log) == 3 and (out / "latest").read_text() == "step-000003"
    assert events[0]["ranks"] == 2 and events[0]["global_batch_tokens"] == 2 * 64
    assert "global batch 2 ranks x 1 micro-batch x 64 tokens = 128 tokens per step" in proc.stderr
    assert not list(out.glob(".log-rank*")), "only rank 0 writes a log"
    # One process accumulating the same two micro-batches gives the same losses.
    single = tmp_path / "single"
    from lockstep import cli
    assert cli.main(["train", "--data", str(data), "--steps", "3", "--seq-len", "32", "--micro-batch-tokens", "64",
                     "--accum", "2", "--out", str(single)]) == 0
    ours = [r["loss"] for r in log]
    ref = [r["loss"] for r in train.read_log(str(single))[0]]
    assert ours == ref
