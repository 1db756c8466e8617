"""Cache-sized chunks (lockstep.numerics.chunks) change no bit: every chunked chain against the same chain
run as one chunk, with chunk boundaries that fall mid-row and mid-vector."""

import pytest
import torch

import lockstep
from lockstep.numerics import chunks
from lockstep import ops
from lockstep.numerics.chunks import row_chunks
from lockstep.train import AdamW, AdamWConfig

ONE_CHUNK = 1 << 40


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_row_chunks_cover_the_rows_in_order():
    assert list(row_chunks(10, 3, elements=7)) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert list(row_chunks(3, 100, elements=7)) == [(0, 1), (1, 2), (2, 3)]   # at least one row
    assert list(row_chunks(5, 0, elements=7)) == [(0, 5)]
    assert list(row_chunks(0, 4)) == []


@pytest.mark.parametrize("op", ["silu_mul", "gelu_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_ops_give_the_bits_of_one_chunk(op, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    # 37 rows of 67: a chunk of 5 rows ends mid vector register, and the last chunk is short.
    gate = (torch.randn(37, 67, generator=gen) * 4).to(dtype)
    up = torch.randn(37, 67, generator=gen).to(dtype)
    grad = torch.randn(37, 67, generator=gen).to(dtype)
    gate[3, 5], up[7, 1] = float("nan"), float("inf")

    def run():
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        with lockstep.use_backend("portable"):
            y = getattr(ops, op)(g, u)
        y.backward(grad)
        return y, g.grad, u.grad

    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", ONE_CHUNK)
    whole = run()
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 5 * 67)
    chunked = run()
    for a, b in zip(whole, chunked):
        assert torch.equal(_bits(a), _bits(b))
    assert whole[0][3, 5].isnan() and not whole[0][4].isnan().any()   # NaN stays in its element


# "transposed fp32": a non-contiguous parameter takes the whole-tensor path, which must agree too.
@pytest.mark.parametrize("case", ["fp32", "bf16 master", "bf16", "transposed fp32"])
def test_adamw_gives_the_bits_of_one_chunk(case, monkeypatch):
    dtype = torch.float32 if "fp32" in case else torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    weights = {"a": torch.randn(33, 29, generator=gen), "b": torch.randn(101, generator=gen)}
    grads = [{n: torch.randn(w.shape, generator=gen).to(dtype) for n, w in weights.items()} for _ in range(3)]

    def run():
        params = [(n, torch.nn.Parameter(w.to(dtype).t() if case == "transposed fp32" and w.dim() == 2 else w.to(dtype)))
                  for n, w in weights.items()]
        opt = AdamW(params, AdamWConfig(lr=1e-2, weight_decay=0.1), master_weights="master" in case)
        for step in grads:
            opt.step(1e-2, grad_scale=0.5,
                     grads={n: (g.t() if case == "transposed fp32" and g.dim() == 2 else g) for n, g in step.items()})
        return [p for _, p in params] + list(opt.state_tensors().values())

    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", ONE_CHUNK)
    whole = run()
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 50)
    chunked = run()
    for a, b in zip(whole, chunked):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_square_sum_gives_the_bits_of_one_chunk(dtype, monkeypatch):
    from lockstep.numerics.fixed_order import row_sum
    from lockstep.train import square_sum

    grad = (torch.randn(3, 41, 130, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    whole = row_sum(row_sum(grad.float().square().reshape(-1, 130))[None])[0]
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 7 * 130)
    assert torch.equal(_bits(square_sum(grad)), _bits(whole))
    assert torch.equal(_bits(square_sum(grad.transpose(0, 1))),
                       _bits(row_sum(row_sum(grad.transpose(0, 1).float().square().reshape(-1, 130))[None])[0]))


def test_a_tree_of_donated_leaves_has_the_bits_of_fresh_nodes():
    """TreeSum adds into donated leaves in place and hands merged-away tensors out again; the sum
    keeps its bits, NaN payloads included, and a leaf its caller keeps is never written."""
    from lockstep.numerics.fixed_order import TreeSum

    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(64, generator=gen) * 10 ** float(i % 5) for i in range(11)]
    leaves[4][7] = float("nan")
    leaves[9][7] = -float("nan")
    plain, donated = TreeSum(), TreeSum()
    kept, given, reused = [], [], 0
    for i, leaf in enumerate(leaves):
        plain.add(i, 1, leaf)
        buf = donated.spare((64,), torch.float32, torch.device("cpu"))
        reused += any(buf is g for g in given)
        given.append(buf)
        buf.copy_(leaf)
        if i % 3 == 2:                                   # every third leaf stays its caller's
            kept.append((buf, leaf))
        donated.add(i, 1, buf, donated=i % 3 != 2)
    assert torch.equal(_bits(plain.total()), _bits(donated.total()))
    assert all(torch.equal(_bits(buf), _bits(leaf)) for buf, leaf in kept)
    assert reused >= 3 and donated._spare is None        # merged-away leaves came back; total() let go
