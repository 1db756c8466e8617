import pytest
import torch

from lockstep import ops
from lockstep.backends import reference
from lockstep.ops import LinearRopeScaling, Llama3RopeScaling

from _contract_checks import DTYPES, assert_op_contract


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_contract(dtype):
    assert_op_contract("rope", dtype)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("scaling", [None, Llama3RopeScaling(factor=8.0, original_max_position_embeddings=64),
                                     LinearRopeScaling(factor=8.0)], ids=["none", "llama3", "linear"])
def test_rope_styles_and_scaling_match_reference(style, scaling):
    torch.manual_seed(0)
    x = torch.randn(50, 4, 64)
    pos = torch.randint(0, 5000, (50,))
    got = ops.rope(x, pos, theta=10000.0, style=style, scaling=scaling)
    want = reference.rope(x, pos, theta=10000.0, style=style, scaling=scaling)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_rope_gradient_is_inverse_rotation():
    x = torch.randn(7, 2, 16, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(7) * 13
    assert torch.autograd.gradcheck(lambda t: ops.rope(t, pos, style="gptj"), (x,))


def test_rope_token_depends_only_on_its_position():
    x = torch.randn(10, 2, 32)
    pos = torch.tensor([5, 0, 9999, 3, 3, 70000, 1, 2, 8, 4])
    full = ops.rope(x, pos)
    assert torch.equal(ops.rope(x[5:6], pos[5:6])[0], full[5])


@pytest.mark.parametrize("call, message", [
    (lambda: ops.rope(torch.randn(3, 2, 8), torch.arange(4)), r"positions: expected shape \[3\]"),
    (lambda: ops.rope(torch.randn(3, 2, 7), torch.arange(3)), "x: expected an even head_dim"),
    (lambda: ops.rope(torch.randn(3, 8), torch.arange(3)), "x: expected a 3-D tensor"),
    (lambda: ops.rope(torch.randn(3, 2, 8), torch.arange(3), style="llama"), "style: expected one of"),
    (lambda: ops.rope(torch.randn(3, 2, 8), torch.arange(3) - 1), "positions: expected values >= 0"),
    (lambda: ops.rope(torch.randn(3, 2, 8), torch.tensor([0, 2 ** 24, 5])),
     r"positions: expected values below 2\^24 = 16777216, found 16777216"),
    (lambda: ops.rope(torch.randn(3, 2, 8), torch.arange(3).float()), "positions: expected an int64"),
    (lambda: ops.rope(torch.randn(3, 2, 8), torch.arange(3), theta=0.5), "theta: expected a finite number > 1"),
])
def test_rope_bad_input(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()


def test_rope_angles_reused_across_calls_still_train_after_inference_mode():
    """The CPU reuses a forward's cos/sin across layers (rotary.rope_cos_sin). Angles first made
    under torch.inference_mode must still serve a later call that autograd saves for backward, and
    a reused result must equal a fresh one bit for bit."""
    from lockstep import rotary

    positions = torch.arange(5, 12)
    x = torch.randn(7, 2, 8)
    rotary._RECENT.clear()
    with torch.inference_mode():
        first = ops.rope(x, positions, theta=1e4)
    xg = x.clone().requires_grad_()
    again = ops.rope(xg, positions, theta=1e4)
    again.sum().backward()
    rotary._RECENT.clear()
    fresh = x.clone().requires_grad_()
    ops.rope(fresh, positions, theta=1e4).sum().backward()
    assert torch.equal(first, again.detach()) and torch.equal(xg.grad, fresh.grad)


@pytest.mark.parametrize("head_dim, theta", [(128, 1_000_000.0), (64, 10_000.0), (96, 500_000.0), (7, 10_000.0)])
def test_inverse_frequencies_are_correctly_rounded(head_dim, theta):
    """Each theta^(-k/head_dim) within half an ulp of the exact value (80 decimal digits here): a
    pow and a reciprocal in float64, as before, missed it in 22 of 64 frequencies at head_dim 128,
    and PyTorch's pow gives other last bits in its vector and scalar kernels (1 of these 64 at
    ATEN_CPU_CAPABILITY=default)."""
    import math
    from decimal import Decimal, localcontext

    from lockstep.rotary import rope_inv_freq

    inv = rope_inv_freq(head_dim, theta).tolist()
    assert len(inv) == len(range(0, head_dim, 2))
    with localcontext() as ctx:
        ctx.prec = 80
        for k, value in zip(range(0, head_dim, 2), inv):
            exact = (Decimal(theta).ln() * -k / head_dim).exp()
            assert abs(Decimal(value) - exact) <= Decimal(math.ulp(value)) / 2, (k, value)


def test_rope_inv_freq_names_a_bad_argument():
    from lockstep.rotary import rope_inv_freq

    with pytest.raises(ValueError, match=r"theta: expected a finite number > 1, got nan"):
        rope_inv_freq(64, float("nan"))
    with pytest.raises(ValueError, match=r"theta: expected a finite number > 1, got 1$"):
        rope_inv_freq(64, 1)
    with pytest.raises(ValueError, match=r"head_dim: expected an int >= 0, got -2"):
        rope_inv_freq(-2, 1e4)


def test_tables_gathered_from_cached_blocks_are_the_direct_ones():
    """The CPU gathers a call's rows from cached blocks of 256 positions (a decode step reuses its
    block): the same bits as computing them for the call, in any order, across blocks, empty, or
    over more blocks than it gathers from."""
    from lockstep.rotary import _cos_sin, rope_cos_sin

    for positions in (torch.tensor([5]), torch.tensor([70000, 3, 3, 255, 256]), torch.arange(1000, 1300),
                      torch.tensor([700, 3], dtype=torch.int32),
                      torch.arange(0, 1 << 20, 97), torch.arange(0)):
        for scaling in (None, Llama3RopeScaling()):
            for dtype in (torch.float32, torch.bfloat16):
                got = rope_cos_sin(positions, 128, 1e6, scaling, dtype)
                want = _cos_sin(positions, 128, 1e6, scaling, dtype)
                assert all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want)), positions[:5]
