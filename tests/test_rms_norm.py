import pytest
import torch

import lockstep
from lockstep import ops
from lockstep.backends import reference
from lockstep.harness.check import check_large

from _contract_checks import DTYPES, assert_op_contract


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
