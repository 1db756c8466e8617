import pytest
import torch

from lockstep import ops
from lockstep.backends import reference
from lockstep.harness.check import check_large

from _contract_checks import DTYPES, assert_op_contract


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_softmax_contract(dtype):
    assert_op_contract("log_softmax", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_softmax_152k_vocab_one_row_vs_many(dtype):
    result = check_large("log_softmax", dtype)
    assert result.passed and result.compared > 0, result


def test_log_softmax_handles_minus_inf_and_float64():
    x = torch.tensor([[0.0, float("-inf"), 1.0]], dtype=torch.float64)
    y = ops.log_softmax(x)
    assert y[0, 1] == float("-inf")
    torch.testing.assert_close(y, reference.log_softmax(x))


def test_log_softmax_empty_last_dim_is_refused():
    with pytest.raises(ValueError, match="x: expected a non-empty last dimension"):
        ops.log_softmax(torch.randn(3, 0))


def test_log_softmax_of_no_rows_has_a_gradient_of_no_rows():
    x = torch.zeros(0, 8, requires_grad=True)
    ops.log_softmax(x).sum().backward()
    assert x.grad.shape == (0, 8)
