"""lockstep.mismatch: the one definition of the sampler-vs-trainer metrics (contract section 4)."""

import pytest
import torch

from lockstep.mismatch import FIELDS, mismatch


def test_metrics_of_a_known_difference():
    sampler = torch.tensor([-1.0, -2.0, -0.5])
    trainer = sampler + torch.tensor([0.0, 0.5, -0.3])
    m = mismatch(trainer, sampler, (0.8, 1.2))
    assert set(m) == set(FIELDS) and m["tokens"] == 3
    d = (trainer.double() - sampler.double())
    assert m["max_abs_dlogp"] == float(d.abs().max())
    assert m["clipfrac0"] == pytest.approx(2 / 3)           # e^0.5 > 1.2 and e^-0.3 < 0.8
    assert m["approx_kl0"] == float((torch.exp(d) - 1 - d).mean())
    assert m["mean_ratio"] == float(torch.exp(d).mean())


def test_equal_bits_give_exactly_zero_and_a_ratio_of_one():
    lp = torch.randn(50, generator=torch.Generator().manual_seed(0)) - 3
    assert mismatch(lp, lp.clone()) == {"tokens": 50, "max_abs_dlogp": 0.0, "approx_kl0": 0.0, "clipfrac0": 0.0,
                                        "mean_ratio": 1.0}
    one_ulp = torch.nextafter(lp, torch.zeros_like(lp))
    assert mismatch(one_ulp, lp)["max_abs_dlogp"] > 0       # a single ulp is seen


def test_no_tokens_and_mismatched_lengths():
    assert mismatch(torch.zeros(0), torch.zeros(0))["tokens"] == 0
    with pytest.raises(ValueError, match="sampler_logprobs: expected 3 logprobs"):
        mismatch(torch.zeros(3), torch.zeros(2))
