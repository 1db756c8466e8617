import pytest
import torch

import lockstep
from lockstep import contract, ops, registry
from lockstep.backends import reference
from lockstep.harness.check import check_op

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


@pytest.mark.parametrize("backend", [registry.cpu_backend(), "portable", "triton"])
def test_gelu_mul_gradient_is_within_twice_eagers_error_where_the_sigmoid_nears_1(backend):
    """d gelu / dg takes 1 - sigmoid(2u) as sigmoid(-2u): computed as 1 - s it lost the digits s
    shares with 1, and d(2u)/dg grows with g^2, so at g in [1.5, 4.5] the fp32 gradient was 3.3x
    eager PyTorch's error (1.5e-6 against 4.6e-7), where the contract allows 2x plus an ulp; and
    `lockstep check --seed S` failed gelu_mul float32 at seeds 1, 3, 4 and 5."""
    g = torch.linspace(1.5, 4.5, 8193)
    g64 = g.double().requires_grad_()
    reference.gelu_mul(g64, torch.ones_like(g64)).backward(torch.ones_like(g64))

    def error(name):
        x = g.clone().requires_grad_()
        with lockstep.use_backend(name):
            ops.gelu_mul(x, torch.ones_like(x)).backward(torch.ones_like(x))
        return float((x.grad.double() - g64.grad).abs().max())

    factor, floor_ulps = contract.relative_to_pytorch()
    allowed = factor * error("eager") + floor_ulps * contract.ulp(torch.float32, float(g64.grad.abs().max()))
    assert error(backend) <= allowed
    if backend == registry.cpu_backend():
        for seed in (1, 3, 4, 5):
            assert check_op("gelu_mul", torch.float32, backend=backend, seed=seed).accuracy.relative_ok, seed


def test_gelu_mul_bad_input():
    with pytest.raises(ValueError, match=r"up: expected shape \(2, 4\)"):
        ops.gelu_mul(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(TypeError, match="up: expected dtype torch.float32"):
        ops.gelu_mul(torch.randn(2, 4), torch.randn(2, 4).half())
    with pytest.raises(TypeError, match="gate: expected dtype float32, bfloat16, float16 or float64"):
        ops.gelu_mul(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
