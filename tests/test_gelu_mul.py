import pytest
import torch

import lockstep
from lockstep import contract, ops
from lockstep.backends import reference

from _contract_checks import DTYPES, assert_op_contract


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_mul_contract(dtype):
    assert_op_contract("gelu_mul", dtype)


def test_gelu_mul_is_transformers_gelu_pytorch_tanh():
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    g, u = torch.randn(64, 96) * 3, torch.randn(64, 96)
    want = ACT2FN["gelu_pytorch_tanh"](g.double()) * u.double()
    tol = contract.tolerance("gelu_mul", torch.float32)
    torch.testing.assert_close(ops.gelu_mul(g, u).double(), want, atol=tol.atol, rtol=tol.rtol)


def test_eager_tanh_depends_on_position_in_the_vector_loop_and_gelu_mul_does_not():
    torch.manual_seed(0)
    g = torch.randn(1 << 16) * 4
    body = torch.nn.functional.gelu(g, approximate="tanh")
    strided = torch.nn.functional.gelu(torch.stack([g, g], 1)[:, 0], approximate="tanh")   # scalar path
    assert not torch.equal(body, strided)
    with lockstep.use_backend("portable"):
        a = ops.gelu_mul(g, torch.ones_like(g))
        b = ops.gelu_mul(torch.stack([g, g], 1)[:, 0], torch.ones_like(g))
    assert torch.equal(a, b)


def test_gelu_mul_extreme_values_match_reference():
    g = torch.tensor([-1e4, -100.0, -20.0, -3.0, 0.0, 3.0, 20.0, 100.0, 1e4, float("inf"), float("-inf")])
    y = ops.gelu_mul(g, torch.ones_like(g))
    want = reference.gelu_mul(g, torch.ones_like(g))
    assert not y[:-1].isnan().any()
    tol = contract.tolerance("gelu_mul", torch.float32)
    torch.testing.assert_close(y[:-1].double(), want[:-1], atol=tol.atol, rtol=tol.rtol)


def test_gelu_mul_gradient_matches_reference():
    torch.manual_seed(1)
    g = (torch.randn(8, 33) * 3).requires_grad_()
    u = torch.randn(8, 33).requires_grad_()
    dy = torch.randn(8, 33)
    torch.autograd.backward(ops.gelu_mul(g, u), dy)
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    torch.autograd.backward(reference.gelu_mul(g64, u64), dy.double())
    tol = contract.tolerance("gelu_mul", torch.float32, "gradient")
    torch.testing.assert_close(g.grad.double(), g64.grad, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(u.grad.double(), u64.grad, atol=tol.atol, rtol=tol.rtol)


def test_gelu_mul_bad_input():
    with pytest.raises(ValueError, match=r"up: expected shape \(2, 4\)"):
        ops.gelu_mul(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(TypeError, match="up: expected dtype torch.float32"):
        ops.gelu_mul(torch.randn(2, 4), torch.randn(2, 4).half())
    with pytest.raises(TypeError, match="gate: expected dtype float32, bfloat16, float16 or float64"):
        ops.gelu_mul(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
