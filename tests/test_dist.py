"""Distributed tests on CPU with gloo: spawned processes write their results to files."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from lockstep import dist as ldist
from lockstep import train
from lockstep.model import ModelConfig, Transformer, logprobs
from lockstep.train import TrainConfig

CFG = dict(steps=4, seq_len=24, micro_batch_tokens=48, accum=1, lr=3e-3, warmup=1)


def _tokens():
    return torch.randint(0, 300, (5000,), generator=torch.Generator().manual_seed(0)).tolist()


def _model(seed=0, **kw):
    return Transformer.from_config(ModelConfig.tiny("qwen3", vocab_size=300, num_heads=8, num_kv_heads=4,
                                                    intermediate_size=192, **kw), seed=seed)


def _write(path, rank, data):
    with open(os.path.join(path, f"rank{rank}.json"), "w") as f:
        json.dump(data, f)


def _read(path, world):
    return [json.load(open(os.path.join(path, f"rank{r}.json"))) for r in range(world)]


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
def test_tensor_parallel_logprobs_are_those_of_one_process(tp, tmp_path):
    ldist.spawn(_tp_worker, tp, str(tmp_path), tp, "float32")
    results = _read(tmp_path, tp)
    seqs = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (17, 5, 30)]
    ref = torch.cat(logprobs(_model(), seqs)).detach()
    for r in results:
        assert r["same_ranks"] and r["compared"] == tp and r["repeat"] and r["grads_same"]
        assert r["tp_size"] == tp
        assert torch.equal(torch.tensor(r["lp"]), ref)
    assert sorted(r["tp_rank"] for r in results) == list(range(tp))


def _tree_all_reduce_worker(rank, world, out):
    torch.manual_seed(rank)
    part = torch.randn(1000)
    total = ldist.tree_all_reduce(part)
    _write(out, rank, {"total": total.tolist(), "part": part.tolist()})


def test_tree_all_reduce_is_the_canonical_tree_on_every_rank(tmp_path):
    from lockstep.numerics.fixed_order import tree_sum

    ldist.spawn(_tree_all_reduce_worker, 4, str(tmp_path))
    results = _read(tmp_path, 4)
    parts = [torch.tensor(r["part"]) for r in results]
    expected = tree_sum(parts)
    assert torch.equal(expected, (parts[0] + parts[1]) + (parts[2] + parts[3]))
    for r in results:
        assert torch.equal(torch.tensor(r["total"]), expected)


def test_a_model_whose_heads_do_not_split_is_refused(tmp_path):
    with pytest.raises(Exception, match="tensor-parallel size 4: expected a divisor of 2"):
        ldist.spawn(_uneven_tp_worker, 4, timeout_s=30)


def _uneven_tp_worker(rank, world):
    ldist.initialize_model_parallel(4)
    ldist.tensor_parallel(Transformer.from_config(ModelConfig.tiny("qwen3", vocab_size=300), seed=0))


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


def _from_rank0_worker(rank, world, out):
    value = ldist.from_rank0(lambda: {"drawn on rank": rank}, "value")
    try:
        ldist.from_rank0(lambda: 1 / 0, "division")
    except (ldist.RankZeroFailed, ZeroDivisionError) as e:
        error = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"value": value, "error": error}, f)


def test_from_rank0_gives_every_rank_rank_0s_result_or_its_error(tmp_path):
    ldist.spawn(_from_rank0_worker, 2, str(tmp_path), timeout_s=30)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["value"] for g in got] == [{"drawn on rank": 0}] * 2
    assert got[0]["error"] == "ZeroDivisionError: division by zero"
    assert got[1]["error"] == "RankZeroFailed: division: rank 0 failed (ZeroDivisionError: division by zero)"
    assert ldist.from_rank0(lambda: 3, "no process group") == 3


def _mismatch_worker(rank, world):
    ldist.check_consistent(_model(seed=rank), TrainConfig(**CFG))


def test_ranks_with_different_parameters_are_refused():
    with pytest.raises(Exception, match="different initial parameters"):
        ldist.spawn(_mismatch_worker, 2, timeout_s=30)


def test_initialize_model_parallel_bad_size(tmp_path):
    with pytest.raises(Exception, match="tensor_model_parallel_size: expected a divisor of the world size 2"):
        ldist.spawn(_bad_tp_worker, 2, timeout_s=30)


def _bad_tp_worker(rank, world):
    ldist.initialize_model_parallel(3)


def test_torchrun_trains_tensor_parallel_with_the_bits_of_one_process(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("abc def ghi " * 500)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = tmp_path / "run"
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(ldist.free_port()), "-m",
                           "lockstep", "train", "--data", str(data), "--steps", "3", "--seq-len", "32",
                           "--micro-batch-tokens", "64", "--accum", "2", "--tp", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log, events = train.read_log(str(out))
    assert len(log) == 3 and (out / "latest").read_text() == "step-000003"
    assert events[0]["ranks"] == 2 and events[0]["tensor_parallel"] == 2 and events[0]["data_parallel"] == 1
    assert events[0]["global_batch_tokens"] == 2 * 64
    assert ("global batch 4 sequences x 32 tokens = 128 tokens per step (1 data-parallel rank x 2 micro-batches "
            "of up to 64 tokens, tensor-parallel size 2)") in proc.stderr
    assert not list(out.glob(".log-rank*")), "only rank 0 writes a log"
    # One process on the same window: the same losses, and the same checkpoint, byte for byte.
    single = tmp_path / "single"
    from lockstep import cli
    assert cli.main(["train", "--data", str(data), "--steps", "3", "--seq-len", "32", "--micro-batch-tokens", "128",
                     "--out", str(single)]) == 0
    assert [(r["loss"], r["grad_norm"]) for r in log] == [(r["loss"], r["grad_norm"]) for r in train.read_log(str(single))[0]]
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (out / "step-000003" / name).read_bytes() == (single / "step-000003" / name).read_bytes(), name


def test_a_tensor_parallel_size_that_does_not_divide_the_ranks_is_refused(tmp_path, capsys):
    from lockstep import cli

    data = tmp_path / "d.txt"
    data.write_text("abc def ghi " * 500)
    assert cli.main(["train", "--data", str(data), "--steps", "1", "--tp", "2", "--out", str(tmp_path / "o")]) == 2
    assert "tensor_parallel: 2 does not divide the 1 rank" in capsys.readouterr().err


def _pair_sum_worker(rank, world, out):
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(100_003, generator=gen) * torch.logspace(-30, 30, 100_003) for _ in range(2)]
    for v in values:                          # signed zeros, infinities, subnormals, near-overflow
        specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, -3.4e38])
        v[:800] = specials.repeat(100)[torch.randperm(800, generator=gen)]
    x = values[rank].clone()
    dist.all_reduce(x)
    torch.save({"got": x, "want": values[0] + values[1]}, os.path.join(out, f"{rank}.pt"))


def test_a_two_rank_all_reduce_is_one_add_per_element(tmp_path):
    """What Parallel.complete's pair rounds rely on: gloo's sum of two ranks is a + b, bitwise."""
    ldist.spawn(_pair_sum_worker, 2, str(tmp_path))
    for rank in range(2):
        r = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(r["got"].view(torch.int32), r["want"].view(torch.int32))
