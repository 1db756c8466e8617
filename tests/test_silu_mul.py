import pytest
import torch

import lockstep
from lockstep import ops
from lockstep.backends import reference

from _contract_checks import DTYPES, assert_op_contract


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_contract(dtype):
    assert_op_contract("silu_mul", dtype)


def test_eager_silu_depends_on_position_in_the_vector_loop():
    """torch's fp32 silu gives other bits in the scalar tail of its vector loop than in the body."""
    torch.manual_seed(0)
    g = torch.randn(1 << 16) * 8
    body = torch.nn.functional.silu(g)
    strided = torch.nn.functional.silu(torch.stack([g, g], 1)[:, 0])  # scalar path
    assert not torch.equal(body, strided)
    with lockstep.use_backend("portable"):
        a = ops.silu_mul(g, torch.ones_like(g))
        b = ops.silu_mul(torch.stack([g, g], 1)[:, 0], torch.ones_like(g))
    assert torch.equal(a, b)


def test_silu_mul_extreme_values_match_reference():
    g = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, float("inf")])
    y = ops.silu_mul(g, torch.ones_like(g))
    assert not y.isnan().any()
    torch.testing.assert_close(y.double(), reference.silu_mul(g, torch.ones_like(g)), atol=1e-5, rtol=1e-5)


def test_silu_mul_bad_input():
    with pytest.raises(ValueError, match=r"up: expected shape \(2, 4\)"):
        ops.silu_mul(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(TypeError, match="up: expected dtype torch.float32"):
        ops.silu_mul(torch.randn(2, 4), torch.randn(2, 4).half())
