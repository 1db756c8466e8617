import itertools

import pytest
import torch

import lockstep
from lockstep import ops
from lockstep.backends import reference
from lockstep.harness.check import check_large

from _contract_checks import DTYPES, assert_op_contract
from _native_helpers import isa  # noqa: F401  (fixture)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_contract(dtype):
    assert_op_contract("rms_norm", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_65536_columns_one_row_vs_many(dtype):
    result = check_large("rms_norm", dtype)
    assert result.passed and result.compared > 0, result


def test_eager_sum_changes_order_at_65536_columns():
    """Why the portable backend never calls torch.sum: with few rows it splits the row across threads."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    differs = 0
    for _ in range(4):
        x = torch.randn(64, 65536, generator=gen)
        # One row at a time (the few-row case that splits a row), 16 sums: two orders often round alike.
        differs += sum(not torch.equal(x[i:i + 1].sum(-1), x.sum(-1)[i:i + 1]) for i in range(4))
    assert differs > 0


def test_rms_norm_gemma_offset():
    x = torch.randn(5, 32)
    w = torch.randn(32) * 0.1
    torch.testing.assert_close(ops.rms_norm(x, w, eps=1e-5, offset=1.0).double(),
                               reference.rms_norm(x, w, eps=1e-5, offset=1.0), atol=1e-5, rtol=1e-5)


def test_rms_norm_nan_row_stays_in_its_row():
    x = torch.randn(4, 64)
    x[2, 5] = float("nan")
    y = ops.rms_norm(x, torch.ones(64))
    assert y[2].isnan().all() and not y[[0, 1, 3]].isnan().any()


@pytest.mark.parametrize("kwargs, message", [
    (dict(eps=0.0), "eps: expected a positive finite number"),
    (dict(eps=-1e-6), "eps: expected a positive finite number"),
    (dict(eps=float("nan")), "eps: expected a positive finite number"),
    (dict(offset=float("inf")), "offset: expected a finite number"),
])
def test_rms_norm_bad_scalars(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), **kwargs)


def test_rms_norm_bad_weight():
    with pytest.raises(ValueError, match=r"weight: expected shape \[8\]"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7))
    with pytest.raises(TypeError, match="weight: expected dtype torch.bfloat16"):
        ops.rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(8))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend: unknown backend 'cuda-fast'"):
        with lockstep.use_backend("cuda-fast"):
            pass


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, every NaN as one: the fused pass stores a NaN sum as one quiet NaN, where ATen's
    add may keep an operand's payload."""
    a, b = (torch.where(t.isnan(), torch.tensor(float("nan"), dtype=t.dtype), t) for t in (a, b))
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}.get(a.dtype, torch.int16)
    return a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("backend", ["native", "triton", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_add_rms_norm_gives_the_bits_of_the_add_and_the_norm(backend, dtype, isa):
    """The residual add and the RMSNorm after it, [T, H] and [B, T, H], Gemma's offset and not, a
    NaN in one row and an Inf in another: the bits of `residual + delta` and `rms_norm`. On the
    native backend, on every instruction set and 1 to 3 threads, fp32 and bf16 in one pass (fp16
    takes the add and the op); on the Triton backend (its interpreter here), every dtype in one
    launch."""
    from lockstep.backends.native import build

    gen = torch.Generator().manual_seed(6)
    names = build.supported_isas() if backend == "native" else [None]
    # The last shape is large enough for the native pass to run on several threads.
    shapes = (((5, 200), 0.0), ((2, 40, 576), 1.0), ((130, 576), 0.0))
    threads_swept = (1, 2, 3) if backend == "native" else (1,)
    for name, threads, (shape, offset) in itertools.product(names, threads_swept, shapes):
        if name is not None:
            isa(name)
        torch.set_num_threads(threads)
        residual, delta = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
        residual.view(-1, shape[-1])[1, 7], delta.view(-1, shape[-1])[3, 0] = float("nan"), float("inf")
        weight = (torch.randn(shape[-1], generator=gen) / 4).to(dtype)
        with lockstep.use_backend(backend), torch.no_grad():
            total, y = ops.add_rms_norm(residual, delta, weight, 1e-6, offset)
            want = residual + delta
            assert _same(total, want) and _same(y, ops.rms_norm(want, weight, 1e-6, offset)), (name, threads, shape)
        rows = y.view(-1, shape[-1])
        assert rows[1].isnan().all() and rows[[0, 2, 4]].isfinite().all()      # the NaN and the Inf stay in their rows


def test_add_rms_norm_on_the_native_backend_is_one_pass_and_keeps_the_gradient_elsewhere(monkeypatch):
    from lockstep.backends.native import rms_norm as native

    passes = []
    add = native.add_forward
    monkeypatch.setattr(native.rms_norm, "add", lambda *a: passes.append(1) or add(*a))
    residual, delta = torch.randn(3, 64), torch.randn(3, 64)
    weight = torch.randn(64, requires_grad=True)
    with torch.no_grad():
        ops.add_rms_norm(residual, delta, weight)
    total, y = ops.add_rms_norm(residual, delta, weight)
    y.sum().backward()
    assert len(passes) == 1 and weight.grad is not None and torch.equal(total, residual + delta)
    mixed, _ = ops.add_rms_norm(residual, delta.to(torch.bfloat16), weight.detach())   # promoted, as `+` does
    assert len(passes) == 1 and mixed.dtype == torch.float32 and torch.equal(mixed, residual + delta.to(torch.bfloat16))


def test_add_rms_norm_on_the_triton_backend_is_one_launch(monkeypatch):
    """Without a gradient, the add and the norm are one launch of the fused kernel, and the norm's own
    kernel does not run; with one, the add and the op, so that the norm's backward has its input."""
    from lockstep.backends.triton import rms_norm as triton_norm

    launches = []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    for name in ("add_rms_norm_fwd_kernel", "rms_norm_fwd_kernel"):
        monkeypatch.setattr(triton_norm, name, Counted(name, getattr(triton_norm, name)))
    residual, delta = torch.randn(3, 64), torch.randn(3, 64)
    weight = torch.randn(64, requires_grad=True)
    with lockstep.use_backend("triton"):
        with torch.no_grad():
            ops.add_rms_norm(residual, delta, weight)
        assert launches == ["add_rms_norm_fwd_kernel"]
        total, y = ops.add_rms_norm(residual, delta, weight)
        y.sum().backward()
    assert launches == ["add_rms_norm_fwd_kernel", "rms_norm_fwd_kernel"] and weight.grad is not None


@pytest.mark.parametrize("make, message", [
    (lambda: ops.add_rms_norm(torch.randn(2, 4), torch.randn(2, 5), torch.ones(4)),
     r"^delta: expected shape \(2, 4\) \(the shape of residual\), got \(2, 5\)$"),
    (lambda: ops.add_rms_norm(torch.randn(2, 4), torch.randn(2, 4, device="meta"), torch.ones(4)),
     r"^delta: expected a tensor on cpu \(the device of residual\), got meta$"),
    (lambda: ops.add_rms_norm(torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int64), torch.ones(4)),
     r"^residual: expected"),
    (lambda: ops.add_rms_norm(torch.randn(2, 4), [1.0], torch.ones(4)), r"^delta: expected a torch.Tensor"),
])
def test_add_rms_norm_names_what_is_wrong(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make()
