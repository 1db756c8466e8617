"""The ops' one-expression acceptance of a common call (docs/adr/0041) against their step-by-step
checks: every argument set the expression accepts, the checks pass, and every one the checks
refuse, the expression sends to them, so the error and its message are the checks' own."""

from __future__ import annotations

import importlib

import pytest
import torch

from lockstep import ops
from lockstep.paged_cache import build_step

# The op modules (lockstep.ops.linear is the function that the package exports under that name).
attention_op, gated_op, linear_op, rms_norm_op = (importlib.import_module(f"lockstep.ops.{name}")
                                                  for name in ("attention", "gated", "linear", "rms_norm"))

def _agrees(op, args: tuple, message: str | None, fast_when_accepted: bool = True) -> None:
    """op's `_check` passes `args` (and, where asked, its `_well_formed` takes them) when message is
    None; else `_well_formed` refuses them and `_check` raises an error that starts with message."""
    if message is None:
        assert op._well_formed(*args) or not fast_when_accepted
        op._check(*args)
        return
    assert not op._well_formed(*args)
    with pytest.raises((TypeError, ValueError)) as e:
        op._check(*args)
    assert str(e.value).startswith(message), str(e.value)


x, w, b = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4)
LINEAR = [
    ((x, w, None, 1, 1), None),
    ((x, w, b, 2, 2), None),
    ((x, w, None, 1, 4), None),
    ((x, w, None, True, 1), "split_k: expected a positive int that divides 8, got True"),
    ((x, w, None, 1.0, 1), "split_k: expected a positive int that divides 8, got 1.0"),
    ((x, w, None, 3, 1), "split_k: expected a positive int that divides 8, got 3"),
    ((x, w, None, 1, 0), "split_n: expected a positive int that divides 4, got 0"),
    ((x, w.double(), None, 1, 1), "weight: expected dtype torch.float32"),
    ((x, w[:, :7], None, 1, 1), "weight: expected shape [N, 8]"),
    ((x, w, b[:3], 1, 1), "bias: expected shape [4], got (3,)"),
    ((x, w, b.half(), 1, 1), "bias: expected dtype torch.float32"),
    ((x, w, b.to("meta"), 1, 1), "bias: expected a tensor on cpu"),
    ((x, w.to("meta"), None, 1, 1), "weight: expected a tensor on cpu"),
    ((x.long(), w, None, 1, 1), "x: expected dtype float32"),
    ((torch.tensor(1.0), w, None, 1, 1), "x: expected at least 1 dimension"),
    (([1.0], w, None, 1, 1), "x: expected a torch.Tensor"),
]


@pytest.mark.parametrize("args, message", LINEAR, ids=[m or "accepted" for _, m in LINEAR])
def test_linear_accepts_in_one_expression_only_what_its_checks_pass(args, message):
    _agrees(linear_op, args, message)


h, g = torch.randn(3, 8), torch.ones(8)
RMS_NORM = [
    ((h, g, 1e-6, 0.0), None),
    ((h, g, 1e-6, 1.0), None),
    ((h, g, 1, 0.0), None),                        # an int eps passes the checks, by their way
    ((h, g, 0.0, 0.0), "eps: expected a positive finite number, got 0.0"),
    ((h, g, float("nan"), 0.0), "eps: expected a positive finite number, got nan"),
    ((h, g, float("inf"), 0.0), "eps: expected a positive finite number, got inf"),
    ((h, g, 1e-6, float("nan")), "offset: expected a finite number, got nan"),
    ((h, g, 1e-6, "1"), "offset: expected a finite number, got '1'"),
    ((h, g[:7], 1e-6, 0.0), "weight: expected shape [8]"),
    ((h, g.bfloat16(), 1e-6, 0.0), "weight: expected dtype torch.float32"),
    ((h.int(), g, 1e-6, 0.0), "x: expected dtype float32"),
]


@pytest.mark.parametrize("args, message", RMS_NORM, ids=[m or "accepted" for _, m in RMS_NORM])
def test_rms_norm_accepts_in_one_expression_only_what_its_checks_pass(args, message):
    _agrees(rms_norm_op, args, message, fast_when_accepted=False)      # an int eps takes the checks' way


GATED = [
    ((h, h.clone()), None),
    ((h, h[:, :7]), "up: expected shape (3, 8) (the shape of gate), got (3, 7)"),
    ((h, h.double()), "up: expected dtype torch.float32"),
    ((h, h.to("meta")), "up: expected a tensor on cpu"),
    ((h.long(), h), "gate: expected dtype float32"),
    ((torch.tensor(1.0), torch.tensor(1.0)), "gate: expected at least 1 dimension"),
    ((h, [1.0]), "up: expected a torch.Tensor"),
]


@pytest.mark.parametrize("args, message", GATED, ids=[m or "accepted" for _, m in GATED])
def test_gated_activations_accept_in_one_expression_only_what_their_checks_pass(args, message):
    _agrees(gated_op, args, message)


def _decode(dtype=torch.float32, hq=4, hkv=2, d=16):
    step, _ = build_step([([0], 2, 3), ([1], 0, 1)], 4, tokens=[1, 2], vocab_size=5)
    q, k, v = torch.randn(2, hq, d, dtype=dtype), torch.randn(2, hkv, d, dtype=dtype), torch.randn(2, hkv, d, dtype=dtype)
    cache = [torch.zeros(3, 4, hkv, d, dtype=dtype) for _ in range(2)]
    return [q, k, v, *cache, step]


def _changed(i, value):
    args = _decode()
    args[i] = value(args[i]) if callable(value) else value
    return args


CACHED = [
    (_decode() + [None, None], None),
    (_decode() + [0.25, 8], None),
    (_decode(torch.bfloat16) + [None, None], None),
    (_decode() + [1, None], "scale: "),                          # an int scale passes the checks; see below
    (_decode() + [-1.0, None], "scale: expected a positive finite number or None, got -1.0"),
    (_decode() + [None, 0], "window: expected a positive int or None, got 0"),
    (_decode() + [None, True], None),                             # True is an int to the checks
    (_changed(1, lambda t: t.double()) + [None, None], "v: expected dtype torch.float64"),
    (_changed(2, lambda t: t[:, :1]) + [None, None], "v: expected shape (2, 2, 16)"),
    (_changed(0, lambda t: t[:, :3]) + [None, None], "k_cache: expected a number of kv heads that divides q's 3"),
    (_changed(4, lambda t: t[:2]) + [None, None], "v_cache: expected shape (3, 4, 2, 16)"),
    (_changed(0, lambda t: t[..., :8]) + [None, None], "k_cache: expected head_dim 8"),
]


@pytest.mark.parametrize("args, message", CACHED, ids=[m or "accepted" for _, m in CACHED])
def test_cached_attention_accepts_in_one_expression_only_what_its_checks_pass(args, message):
    q, k, v, k_cache, v_cache, step, scale, window = args
    if message is None:
        ops.cached_attention(q, k, v, k_cache, v_cache, step, scale=scale, window=window)
        return
    assert not attention_op._cached_well_formed(*args)
    if message == "scale: ":                                      # accepted by the checks as 1.0
        ops.cached_attention(q, k, v, k_cache, v_cache, step, scale=scale, window=window)
        return
    with pytest.raises((TypeError, ValueError)) as e:
        ops.cached_attention(q, k, v, k_cache, v_cache, step, scale=scale, window=window)
    assert str(e.value).startswith(message), str(e.value)


def test_a_models_own_calls_take_the_one_expression():
    """The calls a decode layer makes pass the expression, so the step-by-step checks stay off its path."""
    for extra in ([None, None], [0.25, 8]):
        assert attention_op._cached_well_formed(*_decode(), *extra)
    assert attention_op._cached_well_formed(*_decode(torch.bfloat16), None, None)
    assert linear_op._well_formed(x, torch.nn.Parameter(w), None, 2, 4)
    assert rms_norm_op._well_formed(h, torch.nn.Parameter(g), 1e-6, 0.0)
