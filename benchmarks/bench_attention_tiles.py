"""The Triton attention forward's launch configurations on this GPU, against SDPA in the same process
(needs CUDA).

For each candidate (BLOCK_Q queries per program, warps, stages): the median time of prefill (one
long sequence, and 8 sequences of 512) and of paged decode (1 and 32 sequences), as a ratio to
torch's scaled_dot_product_attention on the same tensors (ratio > 1: lockstep slower), and three bit
checks on this device: the output equals the current configuration's; a sequence's rows are the same
alone and batched with another; a decode query (one row, paged or not) equals its prefill row. The
first candidate is the one fwd_config gives this GPU and dtype. bf16 (or `--fp32`: fp32 keeps the
default tile, ADR 0030), 32 query heads, 8 KV heads, head dim 128.

`--backward`: forward + backward at each candidate BLOCK_Q of the backward kernels (BWD_BLOCK_Q),
timed against SDPA's, with a check that a sequence's gradients are the same alone and batched.

    python benchmarks/bench_attention_tiles.py [--json PATH] [--backward | --backward-only] [--fp32]
"""

import sys

import torch
import torch.nn.functional as F

from lockstep.backends.triton import attention as triton_attention
from lockstep.backends.triton.attention import AttentionConfig, _forward, fwd_config

from bench_gpu import bench as median_ms, write_json

CANDIDATES = [None, AttentionConfig(16, 4, 3), AttentionConfig(32, 4, 3), AttentionConfig(64, 4, 3), AttentionConfig(64, 4, 2),
              AttentionConfig(64, 8, 3), AttentionConfig(128, 8, 3), AttentionConfig(128, 8, 2),
              AttentionConfig(128, 4, 2)]
HQ, HKV, D, PAGE = 32, 8, 128, 16
DEV, DTYPE = "cuda", torch.float32 if "--fp32" in sys.argv else torch.bfloat16
BACKWARD_SEQ = 4096


def prefill(q, k, v, lengths, cfg):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return _forward(q, k, v, cu, cu, None, None, D ** -0.5, True, None, False, cfg)[0]


def paged(k, v, lengths):
    """k, v [sum(lengths), HKV, D] copied into a paged cache: (k_cache, v_cache, block_table)."""
    pages = [-(-n // PAGE) for n in lengths]
    kc = torch.zeros(sum(pages), PAGE, HKV, D, device=DEV, dtype=DTYPE)
    vc = torch.zeros_like(kc)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32, device=DEV)
    start, page = 0, 0
    for b, n in enumerate(lengths):
        for p in range(pages[b]):
            rows = slice(start + p * PAGE, start + min(n, (p + 1) * PAGE))
            kc[page, :rows.stop - rows.start] = k[rows]
            vc[page, :rows.stop - rows.start] = v[rows]
            table[b, p] = page
            page += 1
        start += n
    return kc, vc, table


def decode(q, kc, vc, table, lengths, cfg):
    """One query per sequence (its last position) over the paged cache."""
    cu = list(range(len(lengths) + 1))
    return _forward(q, kc, vc, cu, None, list(lengths), table, D ** -0.5, True, None, True, cfg)[0]


def bit_checks(cfg, reference):
    torch.manual_seed(0)
    lengths = [300, 77]
    q = torch.randn(sum(lengths), HQ, D, device=DEV, dtype=DTYPE)
    k, v = (torch.randn(sum(lengths), HKV, D, device=DEV, dtype=DTYPE) for _ in range(2))
    both = prefill(q, k, v, lengths, cfg)
    alone = prefill(q[:300], k[:300], v[:300], [300], cfg)
    one = _forward(q[299:300], k[:300], v[:300], [0, 1], [0, 300], None, None, D ** -0.5, True, None, False, cfg)[0]
    kc, vc, table = paged(k, v, lengths)
    last = torch.stack([q[299], q[376]])
    dec = decode(last, kc, vc, table, lengths, cfg)
    return dict(same_as_current=None if reference is None else torch.equal(both, reference),
                batch_invariant=torch.equal(both[:300], alone),
                decode_equals_prefill=torch.equal(one[0], both[299]) and torch.equal(dec[0], both[299])
                and torch.equal(dec[1], both[376])), both


def timings(cfg):
    out = {}
    for name, lengths in (("prefill 1x8192", [8192]), ("prefill 8x512", [512] * 8)):
        b, n = len(lengths), lengths[0]
        q = torch.randn(b * n, HQ, D, device=DEV, dtype=DTYPE)
        k, v = (torch.randn(b * n, HKV, D, device=DEV, dtype=DTYPE) for _ in range(2))
        ours = median_ms(lambda: prefill(q, k, v, lengths, cfg), 10)
        qs, ks, vs = (t.view(b, n, -1, D).transpose(1, 2) for t in (q, k, v))
        ref = median_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True), 10)
        out[name] = (ours, ref)
    for name, lengths in (("decode 1x4096", [4096]), ("decode 32x1024", [1024] * 32)):
        b, n = len(lengths), lengths[0]
        k, v = (torch.randn(b * n, HKV, D, device=DEV, dtype=DTYPE) for _ in range(2))
        kc, vc, table = paged(k, v, lengths)
        q = torch.randn(b, HQ, D, device=DEV, dtype=DTYPE)
        ours = median_ms(lambda: decode(q, kc, vc, table, lengths, cfg))
        qs, ks, vs = q[:, :, None], k.view(b, n, HKV, D).transpose(1, 2), v.view(b, n, HKV, D).transpose(1, 2)
        ref = median_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
        out[name] = (ours, ref)
    return out


def backward_rows() -> list[dict]:
    print("| backward BLOCK_Q | shape | lockstep fwd+bwd ms | SDPA fwd+bwd ms | ratio | grads batch invariant |")
    print("|---|---|---|---|---|---|")
    rows, default = [], dict(triton_attention.BWD_BLOCK_Q)

    def grads(q, k, v, lengths):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        out = triton_attention.attention(q, k, v, cu, cu, D ** -0.5, True, None)
        out.backward(torch.ones_like(out))
        return q.grad, k.grad, v.grad

    torch.manual_seed(0)
    q = torch.randn(1300, HQ, D, device=DEV, dtype=DTYPE)
    k, v = (torch.randn(1300, HKV, D, device=DEV, dtype=DTYPE) for _ in range(2))
    n = BACKWARD_SEQ
    qt = torch.randn(n, HQ, D, device=DEV, dtype=DTYPE)
    kt, vt = (torch.randn(n, HKV, D, device=DEV, dtype=DTYPE) for _ in range(2))
    qs, ks, vs = (t.transpose(0, 1)[None].detach().requires_grad_() for t in (qt, kt, vt))

    def sdpa():
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).sum().backward()

    try:
        for block_q in (16, 32, 64, 128):
            triton_attention.BWD_BLOCK_Q.update({k: block_q for k in default})
            try:
                both, alone = grads(q, k, v, [1000, 300]), grads(q[:1000], k[:1000], v[:1000], [1000])
                invariant = all(torch.equal(a[:1000], b) for a, b in zip(both, alone))
                ours = median_ms(lambda: grads(qt, kt, vt, [n]), 5)
            except Exception as e:
                print(f"| {block_q} | - | failed: {type(e).__name__}: {str(e)[:80]} | | | |", flush=True)
                continue
            ref = median_ms(sdpa, 5)
            rows.append(dict(backward_block_q=block_q, shape=f"1x{n}", ms=ours, sdpa_ms=ref, invariant=invariant))
            print(f"| {block_q} | 1x{n} | {ours:.3f} | {ref:.3f} | {ours / ref:.2f} | {invariant} |", flush=True)
    finally:
        triton_attention.BWD_BLOCK_Q.update(default)
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_attention_tiles: no CUDA device; nothing measured")
        return 1
    dtype = str(DTYPE).removeprefix("torch.")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, {dtype} {HQ}q:{HKV}kv d={D}")
    print("| BLOCK_Q, warps, stages | shape | lockstep ms | SDPA ms | ratio | same as current | batch invariant "
          "| decode == prefill |")
    print("|---|---|---|---|---|---|---|---|")
    rows, reference = [], None
    for cfg in CANDIDATES if "--backward-only" not in sys.argv else []:
        cfg = cfg or fwd_config(DTYPE)
        try:
            checks, out = bit_checks(cfg, reference)
            times = timings(cfg)
        except Exception as e:  # a configuration that does not fit this GPU is reported, not fatal
            print(f"| {tuple(cfg)} | - | failed: {type(e).__name__}: {str(e)[:80]} | | | | | |", flush=True)
            continue
        reference = out if reference is None else reference
        for shape, (ours, ref) in times.items():
            rows.append(dict(config=list(cfg), shape=shape, ms=ours, sdpa_ms=ref, **checks))
            print(f"| {cfg.block_q}, {cfg.num_warps}, {cfg.num_stages} | {shape} | {ours:.3f} | {ref:.3f} | "
                  f"{ours / ref:.2f} | {checks['same_as_current']} | {checks['batch_invariant']} | "
                  f"{checks['decode_equals_prefill']} |", flush=True)
    if "--backward" in sys.argv or "--backward-only" in sys.argv:
        rows += backward_rows()
    write_json(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
