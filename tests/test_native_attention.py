"""The native attention (attention.c, attention_backward.c): the forward's and the backward's
documented arithmetic, packed and under an explicit mask, and keys and queries that a row cannot see
kept out of it."""

from __future__ import annotations

import pytest
import torch

from lockstep import ops
from lockstep.backends.native import gemm, masked_attention, unary

from _native_helpers import _fma32
from _native_helpers import isa  # noqa: F401  (fixtures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_order_is_the_documented_one(dtype):
    """attention.c's forward, restated in Python for one sequence of 70 keys (two 64-key
    blocks) with a window that cuts into the first: the GEMM's scores times the scale, the block
    max, exp_log.c's exp, the block sum as 16 lane sums folded, the output as one FMA chain per
    dimension over the visible keys, rescaled by alpha, divided by the sum at the end. A query alone
    (decode) gives the same bits as inside the prefill."""
    from lockstep.backends.native.attention import attention_forward

    gen = torch.Generator().manual_seed(2)
    n, d, window, scale = 70, 20, 67, 0.3
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype) for h in (2, 1, 1))
    out, row_max, row_sum = attention_forward(q, k, v, [0, n], [n], [0], None, scale, True, window)
    qf, kf, vf = q.float(), k.float(), v.float()
    for t in (0, 40, 63, 64, 69):
        one, _, _ = attention_forward(q[t:t + 1], k[:t + 1], v[:t + 1], [0, 1], [t + 1], [0], None, scale, True,
                                      window)
        assert torch.equal(one[0], out[t]), t
        for h in range(2):
            m, l, o = _attention_row(qf[t, h], kf[:, 0], vf[:, 0], [j for j in range(t + 1) if j > t - window], 0,
                                     scale)
            assert torch.equal(row_max[t, h], m) and torch.equal(row_sum[t, h], l), (t, h)
            assert torch.equal(out[t, h], o), (t, h)


def _attention_row(q, k, v, keys, anchor, scale):
    """attention.c's arithmetic for one query row q [D] over the visible `keys` (ascending indices
    into k, v [L, D], fp32: 16-bit operands widened first, as the kernel's scores are the fp32
    GEMM's dot of the widened values), in 64-key blocks from `anchor`: (row max, row sum, output)."""
    d = q.shape[0]
    m, l, acc = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(d)
    for k0 in range(anchor, k.shape[0], 64):
        block = [j for j in keys if k0 <= j < k0 + 64]
        if not block:
            continue
        s = gemm.gemm_nt(q[None], k[block])[0] * scale
        new = torch.maximum(m, s.max())
        shift = torch.where(new == float("-inf"), torch.tensor(0.0), new)
        alpha = unary.exp((m - shift)[None])[0]
        p = torch.zeros(64)
        p[[j - k0 for j in block]] = unary.exp(s - shift)
        lanes = ((p[0:16] + p[16:32]) + p[32:48]) + p[48:64]
        tt = lanes[:8] + lanes[8:]
        u = tt[:4] + tt[4:]
        w = u[:2] + u[2:]
        l = l * alpha + (w[0] + w[1])
        pv = torch.zeros(d)
        for j in block:
            pv = _fma32(p[j - k0].expand(d), v[j], pv)
        acc = acc * alpha + pv
        m = new
    return m, l, acc / (l if l != 0 else torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_masked_attention_order_is_the_documented_one(dtype):
    """The same arithmetic under an explicit mask with holes (masked_attention, the mode's attention):
    only the keys the mask shows enter a row, its blocks start at the first of them (2 and 7 here:
    left padding), k and v are read in place from [B, Hkv, Lk, D], and a row that sees no key gets
    zeros and a logsumexp of -inf. Each row equals itself computed alone (one query, decode)."""
    gen = torch.Generator().manual_seed(3)
    b, lq, lk, d, scale = 2, 5, 140, 24, 0.2
    q = torch.randn(b, 4, lq, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, 2, lk, d, generator=gen).to(dtype) for _ in range(2))
    visible = torch.rand(b, lq, lk, generator=gen) < 0.7
    visible[0, :, :2] = False
    visible[1, :, :7] = False
    visible[0, :, 2] = visible[1, :, 7] = True
    visible[1, 3] = False
    out, lse = ops.masked_attention(q, k, v, visible, scale)
    qf, kf, vf = q.float(), k.float(), v.float()
    for i in range(b):
        for t in range(lq):
            keys = torch.nonzero(visible[i, t])[:, 0].tolist()
            one, one_lse = ops.masked_attention(q[i:i + 1, :, t:t + 1], k[i:i + 1], v[i:i + 1], visible[i:i + 1, t:t + 1],
                                                scale)
            assert torch.equal(one[0, :, 0], out[i, :, t]) and torch.equal(one_lse[0, :, 0], lse[i, :, t]), (i, t)
            for h in range(4):
                m, l, o = _attention_row(qf[i, h, t], kf[i, h // 2], vf[i, h // 2], keys, keys[0] if keys else 0,
                                         scale)
                assert torch.equal(out[i, h, t].float(), o.to(dtype).float()), (i, t, h)
                assert torch.equal(lse[i, h, t], m + unary.log(l[None])[0]), (i, t, h)
    assert (out[1, :, 3] == 0).all() and (lse[1, :, 3] == float("-inf")).all()


def test_attention_never_reads_a_key_into_a_row_that_cannot_see_it():
    """A NaN key at position 60 reaches the queries at 60 and after, not the ones before it, though
    they share its 64-key block; and a NaN value reaches no query that cannot see it (contract,
    section 7; the portable op lets it through 0 * NaN)."""
    from lockstep.backends.native.attention import attention_forward

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(64, 2, 16, generator=gen) for _ in range(3))
    k[60, 0, 3] = float("nan")
    v[62, 1, 5] = float("nan")
    out, _, _ = attention_forward(q, k, v, [0, 64], [64], [0], None, 0.25, True, None)
    assert torch.isfinite(out[:60]).all() and torch.isfinite(out[60:62, 1]).all()
    assert torch.isnan(out[60:, 0]).all() and torch.isnan(out[62:, 1, 5]).all()


def _fold16(lanes: torch.Tensor) -> torch.Tensor:
    t = lanes[:8] + lanes[8:]
    u = t[:4] + t[4:]
    w = u[:2] + u[2:]
    return w[0] + w[1]


def _attention_backward(qf, kf, vf, gf, row_max, row_sum, keys_of, anchor_of, scale):
    """attention_backward.c's arithmetic for the rows (t, h) of one sequence and KV head, restated:
    qf, gf [Lq, G, D] and kf, vf [Lk, D] fp32 (16-bit operands widened first), row_max, row_sum
    [Lq, G] the forward's, keys_of[t] the keys token t sees (ascending), anchor_of[t] its first
    block's start. Returns (dq [Lq, G, D], dk, dv [Lk, D]), fp32."""
    lq, g_size, d = qf.shape
    rows = [(t, h) for t in range(lq) for h in range(g_size)]          # row i = t * G + h
    dq, dk, dv = torch.zeros(lq, g_size, d), torch.zeros(kf.shape), torch.zeros(kf.shape)
    p, ds = {}, {}
    for t, h in rows:
        keys = keys_of[t]
        if not keys:
            continue
        s = gemm.gemm_nt(qf[t, h][None], kf[keys])[0] * scale
        pt = unary.exp(s - row_max[t, h]) / row_sum[t, h]
        dp = gemm.gemm_nt(gf[t, h][None], vf[keys])[0]
        starts = range(anchor_of[t], keys[-1] + 1, 64)
        delta = torch.tensor(0.0)
        for k0 in starts:
            w = torch.zeros(64)
            block = [i for i, j in enumerate(keys) if k0 <= j < k0 + 64]
            if block:
                w[[keys[i] - k0 for i in block]] = pt[block] * dp[block]
                delta = delta + _fold16(((w[0:16] + w[16:32]) + w[32:48]) + w[48:64])
        dst = pt * (dp - delta)
        acc = torch.zeros(d)
        for k0 in starts:
            part = torch.zeros(d)
            for i, j in enumerate(keys):
                if k0 <= j < k0 + 64:
                    part = _fma32(dst[i].expand(d), kf[j], part)
            acc = acc + part
        dq[t, h] = acc * scale
        p.update({(t, h, j): pt[i] for i, j in enumerate(keys)})
        ds.update({(t, h, j): dst[i] for i, j in enumerate(keys)})
    for j in range(kf.shape[0]):
        seeing = [(t, h) for t, h in rows if (t, h, j) in p]
        acc_k, acc_v = torch.zeros(d), torch.zeros(d)
        for r0 in range(0, len(seeing), 64):
            group_k, group_v = torch.zeros(d), torch.zeros(d)
            for r1 in range(r0, min(r0 + 64, len(seeing)), 8):
                run_k, run_v = torch.zeros(d), torch.zeros(d)
                for t, h in seeing[r1:min(r1 + 8, r0 + 64)]:
                    run_k = _fma32(ds[t, h, j].expand(d), qf[t, h], run_k)
                    run_v = _fma32(p[t, h, j].expand(d), gf[t, h], run_v)
                group_k, group_v = group_k + run_k, group_v + run_v
            acc_k, acc_v = acc_k + group_k, acc_v + group_v
        dk[j], dv[j] = acc_k * scale, acc_v
    return dq, dk, dv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("isa_name", ["scalar", "avx2", "avx512"])
def test_attention_backward_order_is_the_documented_one(dtype, isa_name, isa):
    """attention_backward.c's backward, restated in Python for one sequence of 70 tokens (two 64-key
    blocks; 140 rows of a KV head, up to 134 of which see one key) with a window that cuts into the
    first: p from the forward's scores, max and sum; dp by the GEMM's dot; delta as the blocks'
    folded lane sums of p dp; dq as one FMA chain per key block, the blocks added in order; dk and
    dv over the rows that see the key as one FMA chain per run of 8, the runs added in groups of 64,
    the groups added in order."""
    from lockstep.backends.native.attention import attention_backward, attention_forward

    isa(isa_name)
    gen = torch.Generator().manual_seed(5)
    n, d, window, scale = 70, 72, 67, 0.3      # d: four chunks of 16 and a part of one
    q, go = (torch.randn(n, 2, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(n, 1, d, generator=gen).to(dtype) for _ in range(2))
    _, row_max, row_sum = attention_forward(q, k, v, [0, n], [n], [0], None, scale, True, window)
    dq, dk, dv = attention_backward(q, k, v, go, row_max, row_sum, [0, n], [n], [0], scale, True, window)
    keys_of = [[j for j in range(t + 1) if j > t - window] for t in range(n)]
    want = _attention_backward(q.float(), k.float()[:, 0], v.float()[:, 0], go.float(), row_max, row_sum, keys_of,
                               [0] * n, scale)
    assert torch.equal(dq, want[0]) and torch.equal(dk[:, 0], want[1]) and torch.equal(dv[:, 0], want[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_masked_attention_backward_order_is_the_documented_one(dtype):
    """The same arithmetic under an explicit mask with holes: each row's blocks start at the first
    key it sees (2 and 7 here: left padding), a row that sees nothing adds nothing, and rows that
    see nothing (padding) are not counted in a key's groups of 64 rows."""
    gen = torch.Generator().manual_seed(7)
    b, lq, lk, d, scale = 2, 40, 140, 24, 0.2
    q, go = (torch.randn(b, 4, lq, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, 2, lk, d, generator=gen).to(dtype) for _ in range(2))
    visible = torch.rand(b, lq, lk, generator=gen) < 0.7
    visible[0, :, :2] = False
    visible[1, :, :7] = False
    visible[0, :, 2] = visible[1, :, 7] = True
    visible[1, 3] = visible[1, 10] = False
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = ops.masked_attention(q, k, v, visible, scale)
    out.backward(go)
    with torch.no_grad():
        _, _, (row_max, row_sum) = masked_attention.forward(q, k, v, visible, scale)
    for i in range(b):
        keys_of = [torch.nonzero(visible[i, t])[:, 0].tolist() for t in range(lq)]
        for hk in range(2):
            heads = slice(2 * hk, 2 * hk + 2)
            want = _attention_backward(q.detach()[i, heads].float().transpose(0, 1), k.detach()[i, hk].float(),
                                       v.detach()[i, hk].float(), go[i, heads].float().transpose(0, 1),
                                       row_max[i, :, heads], row_sum[i, :, heads], keys_of,
                                       [keys[0] if keys else 0 for keys in keys_of], scale)
            assert torch.equal(q.grad[i, heads].transpose(0, 1).float(), want[0].to(dtype).float()), (i, hk)
            assert torch.equal(k.grad[i, hk].float(), want[1].to(dtype).float()), (i, hk)
            assert torch.equal(v.grad[i, hk].float(), want[2].to(dtype).float()), (i, hk)
    assert (q.grad[1, :, 3] == 0).all()


def test_attention_backward_keeps_a_nan_query_in_its_own_row_and_keys():
    """A NaN query (token 30, head 1) reaches the dk and dv of the keys it sees and nothing else: the
    other rows' dq and the keys after it stay finite."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, go = (torch.randn(64, h, 16, generator=gen) for h in (2, 1, 1, 2))
    q[30, 1, 4] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, 64], dtype=torch.int32)
    ops.attention(q, k, v, cu, cu, 0.25, True, None).backward(go)
    others = torch.ones(64, 2, dtype=torch.bool)
    others[30, 1] = False
    assert torch.isfinite(q.grad[others]).all() and torch.isnan(q.grad[30, 1]).all()
    assert torch.isnan(k.grad[:31]).any() and torch.isfinite(k.grad[31:]).all() and torch.isfinite(v.grad[31:]).all()
