"""The LM head's per-chunk row arithmetic in C (lm_head.c): lse_fold and logit_grad with
fixed_order's compositions' bits, the row max, and the arguments refused."""

from __future__ import annotations

import pytest
import torch

from lockstep.backends.native import build
from lockstep.harness.check import num_threads

from _native_helpers import DTYPES, _bits
from _native_helpers import isa, unfused  # noqa: F401  (fixtures)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_fold_and_logit_grad_in_c_are_the_compositions_bit_for_bit(unfused, dtype):
    """The LM head's per-chunk row arithmetic in C against fixed_order's compositions: a first and a
    later chunk of the online log-sum-exp, both as one call's pieces (lse_fold's width; the later one
    shorter) from nothing and after a first chunk, and the logits' gradient in fp32 and bf16, at
    lengths below, at and past the sum's 512 lanes, at temperatures 1 and 0.7, with NaN, Inf and
    -inf logits, a NaN running max and a target in and outside the chunk, on 1 and 2 threads. NaN is
    compared as NaN (`_bits`)."""
    from lockstep.numerics import fixed_order as fo
    from lockstep.backends.native.cpu import KERNELS

    gen = torch.Generator().manual_seed(7)
    for length in (1, 3, 100, 512, 513, 4096):
        rows = 37
        first, later = ((torch.randn(rows, length, generator=gen) * 4).to(dtype) for _ in range(2))
        first[1, length // 2] = float("nan")
        first[2, 0] = float("inf")
        later[3] = float("-inf")
        later[4] = -0.0
        later[5, length - 1] = float("inf")
        lse = torch.randn(rows, generator=gen) + 8
        lse[6] = float("nan")
        local = torch.randint(0, length, (rows,), generator=gen)
        inside = (torch.rand(rows, generator=gen) < 0.5).float()
        scale = torch.randn(rows, generator=gen)
        wide = torch.randn(rows, length + 3, generator=gen).to(dtype)
        wide[:, :length] = later
        later = wide[:, :length]                             # rows length + 3 elements apart
        pieces = torch.cat([first, later[:, :max(1, length // 2)]], dim=1)
        for temperature in (1.0, 0.7):
            for threads in (1, 2):
                results = []
                for kernels in (unfused, KERNELS):
                    with num_threads(threads):
                        run = fo.lse_fold(first, temperature, None, kernels=kernels)
                        nan_run = (run[0].clone(), run[1])
                        nan_run[0][7] = float("nan")
                        results.append((*run, *fo.lse_fold(later, temperature, run, kernels=kernels),
                                        *fo.lse_fold(later, temperature, nan_run, kernels=kernels),
                                        *fo.lse_fold(pieces, temperature, None, width=length, kernels=kernels),
                                        *fo.lse_fold(pieces, temperature, run, width=length, kernels=kernels),
                                        *(fo.logit_grad(chunk, temperature, lse, local, inside, scale, out,
                                                        kernels=kernels)
                                          for chunk in (first, later) for out in (torch.float32, torch.bfloat16))))
                for i, (want, got) in enumerate(zip(*results)):
                    assert want.dtype == got.dtype and torch.equal(_bits(want), _bits(got)), \
                        (i, length, temperature, threads)


def test_a_row_max_is_the_first_of_its_value_on_every_instruction_set(isa):
    """The row max of the C row kernels (the online log-sum-exp's running max here) is found lane by
    lane, yet is the one a scalar loop from -inf keeps: where the largest value is zero, the first
    zero, of either sign, at any position around the 16 lanes; the first NaN; -inf for -inf rows."""
    from lockstep.backends.native import rows

    length = 20_000  # 6 rows of it run on 2 threads
    x = -torch.rand(6, length) - 0.5
    x[0, 7], x[0, 40] = -0.0, 0.0
    x[1, 7], x[1, 40] = 0.0, -0.0
    x[2, 97], x[2, 98] = -0.0, 0.0                            # past the last whole 16 lanes
    x[3, 16], x[3, 1] = 0.0, -0.0
    x[4, 50] = float("nan")
    x[5] = float("-inf")
    want = torch.tensor([-0.0, 0.0, -0.0, -0.0, float("nan"), float("-inf")])
    for name in build.supported_isas():
        isa(name)
        for threads in (1, 2):
            with num_threads(threads):
                run_max, _ = rows.lse_fold(x, 1.0, None)
            assert torch.equal(_bits(run_max), _bits(want)), (name, threads)


def test_the_logit_row_kernels_name_a_bad_argument():
    from lockstep.backends.native import rows

    chunk = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"local: expected shape \[3\], got \[2\]"):
        rows.logit_grad(chunk, 1.0, torch.zeros(3), torch.zeros(2, dtype=torch.int64), torch.zeros(3), torch.ones(3),
                        torch.float32)
    with pytest.raises(ValueError, match=r"run sum: expected shape \[3\], got \[3, 1\]"):
        rows.lse_fold(chunk, 1.0, (torch.zeros(3), torch.zeros(3, 1)))
    with pytest.raises(ValueError, match="width: expected a positive number of columns, got 0"):
        rows.lse_fold(chunk, 1.0, None, width=0)
    from lockstep.numerics import fixed_order as fo

    with pytest.raises(ValueError, match="width: expected a positive number of columns, got -1"):
        fo.lse_fold(chunk, 1.0, None, width=-1)
    with pytest.raises(ValueError, match="out_dtype: expected torch.float32 or torch.bfloat16, got torch.float16"):
        rows.logit_grad(chunk, 1.0, torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3), torch.float16)
    with pytest.raises(RuntimeError, match="ls_logit_rows refused mode 1"):
        rows.logit_grad(chunk, 1.0, torch.zeros(3), torch.full((3,), 8), torch.zeros(3), torch.ones(3), torch.float32)
