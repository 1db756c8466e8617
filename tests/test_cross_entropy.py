import pytest
import torch
import torch.nn.functional as F

from lockstep import ops
from lockstep.backends import reference

from _contract_checks import DTYPES, assert_op_contract


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_contract(dtype):
    assert_op_contract("cross_entropy", dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_pytorch_semantics(reduction):
    torch.manual_seed(0)
    logits = torch.randn(40, 300, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (40,))
    targets[::4] = -100
    got = ops.cross_entropy(logits, targets, reduction=reduction)
    want = F.cross_entropy(logits, targets, reduction=reduction)
    torch.testing.assert_close(got, want)
    g1, = torch.autograd.grad(got.sum(), logits)
    g2, = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g1, g2)


def test_cross_entropy_all_ignored_is_nan_like_pytorch():
    logits = torch.randn(4, 10, requires_grad=True)
    targets = torch.full((4,), -100)
    loss = ops.cross_entropy(logits, targets)
    assert loss.isnan() and F.cross_entropy(logits, targets).isnan()
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros(4, 10))


def test_cross_entropy_mean_unchanged_by_appended_ignored_rows():
    torch.manual_seed(0)
    logits = torch.randn(300, 500)
    targets = torch.randint(0, 500, (300,))
    pad = torch.randn(45, 500)
    a = logits.clone().requires_grad_()
    b = torch.cat([logits, pad]).requires_grad_()
    la = ops.cross_entropy(a, targets)
    lb = ops.cross_entropy(b, torch.cat([targets, torch.full((45,), -100)]))
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    assert torch.equal(a.grad, b.grad[:300]) and torch.equal(b.grad[300:], torch.zeros(45, 500))


def test_cross_entropy_custom_ignore_index_and_float64_reference():
    logits = torch.randn(6, 7, dtype=torch.float64)
    targets = torch.tensor([0, 3, 6, 6, 2, 1])
    torch.testing.assert_close(ops.cross_entropy(logits, targets, ignore_index=6),
                               reference.cross_entropy(logits, targets, ignore_index=6))


@pytest.mark.parametrize("kwargs, targets, message", [
    ({}, torch.tensor([0, 10]), r"targets: expected values in \[0, 10\) or -100 \(ignore_index\), found 10"),
    ({"reduction": "avg"}, torch.tensor([0, 1]), "reduction: expected one of"),
    ({}, torch.tensor([0, 1, 2]), r"targets: expected shape \(2,\)"),
])
def test_cross_entropy_bad_input(kwargs, targets, message):
    with pytest.raises(ValueError, match=message):
        ops.cross_entropy(torch.randn(2, 10), targets, **kwargs)
