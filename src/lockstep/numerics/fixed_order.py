"""Fixed-order building blocks: every reduction order lockstep decides, in one place.

The portable backend, the batch-invariant mode, the trainer and the harness all import from here;
the Triton backend shares the block sizes and the loss reductions. Every reduction the portable
backend performs goes through one of the functions below, so the order of floating-point additions
depends only on the reduced length, never on how many rows share the call, their order, the memory
layout or the thread count (docs/contract.md, section 2):

- `row_sum`: a sum over the last dimension built only from elementwise adds (exact per element in
  every code path), in a shape that depends on the row length alone.
- `matmul_rows`: a GEMM whose row dimension is cut into fixed-shape tiles, so the BLAS library sees
  the same problem shape whatever the batch size (docs/adr/0001-fixed-tiles-and-reduction-order.md).
  Under the "native" CPU kernels (`cpu_kernels`), lockstep's own C kernels run it instead, in one
  reduction order on every CPU, instruction set and thread count (docs/adr/0010-native-cpu-backend.md);
  so do `exp` and `log`, whose bits MKL's vector math otherwise picks by instruction set.
- `weight_grad` and `column_sum`: the order in which weight gradients reduce over rows: fixed
  blocks of `ROW_BLOCK` rows, each block's contribution produced by a fixed-shape kernel and added
  in block order. Zero rows appended at the end (padding) add exact zeros and change no bit.
- `TreeSum` and `tree_sum`: the one tree by which partial sums over an index combine, wherever the
  parts were computed: the units of a training window (lockstep.numerics.grad_tree, docs/adr/0007) and the
  `TP_SPLIT` parts of a reduction that tensor parallelism may shard (`split_sum`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator, NamedTuple

import torch
from torch import Tensor

# Rows per GEMM call in the bulk of a batch, and the tile shapes of the tail (the rows after the
# last full ROW_TILE, largest first; the last few rows zero-padded to TAIL_TILE). Every shape goes
# through the same M-blocked BLAS kernel, whose reduction order over K depends on K alone (ADR
# 0001); the small tiles keep decode (one row) from paying for a full 128-row tile, and a
# sequence-sized tail (127 rows) from taking sixteen 8-row calls. Below 4 rows MKL switches to a
# GEMV path with other bits, so every tile must stay >= 4 (tests/test_portable.py).
ROW_TILE = 128
TAIL_TILES = (64, 32, 16, 8)
TAIL_TILE = TAIL_TILES[-1]
# bf16 on a CPU adds a 4-row tile: oneDNN's bf16 GEMM gives 4 rows the bits of 128 (and runs them
# at about GEMV speed, where an 8-row tile costs 1.3x), so decode's one row pays for 4, not 8. MKL's
# fp32 4-row tile is not faster than its 8-row one.
CPU_BF16_TAIL_TILES = TAIL_TILES + (4,)


def tail_tiles(dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """The tail tile shapes `matmul_rows` uses for a dtype on a device, largest first."""
    return CPU_BF16_TAIL_TILES if dtype == torch.bfloat16 and device.type == "cpu" else TAIL_TILES
# Width of the sequential stage of `row_sum`; the remaining WIDTH lanes are folded pairwise.
SUM_WIDTH = 512
# Rows per block in weight-gradient reductions.
ROW_BLOCK = 128
# Columns per GEMM call in fp32 on a CPU (matmul_rows), for speed. A column's bits do not depend on
# the call's N (tensor parallelism relies on it: a column-parallel shard is a call with fewer
# columns), so the chunks give the bits of one call (tests/test_portable.py).
COLUMN_CHUNK = 4096
# Keys per block of attention's online softmax; blocks are anchored at key 0 (ADR 0002).
KEY_BLOCK = 64
# The parts a reduction over a dimension that tensor parallelism may shard (a row-parallel linear's
# K, a column-parallel linear's N in backward, attention heads) is split into, at every
# tensor-parallel size: a TP rank computes a contiguous run of parts and the ranks complete the
# same tree (ADR 0007). Tensor-parallel sizes must divide it.
TP_SPLIT = 4


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for 16- and 32-bit floats; float64 passes through."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ceil_div(n: int, d: int) -> int:
    """The number of blocks of `d` that cover `n` (n >= 0, d > 0)."""
    return -(-n // d)


def row_sum(x: Tensor) -> Tensor:
    """Sum over the last dimension in a fixed order that depends only on its length.

    x: [..., L] float tensor (any layout). Returns [...] of x's dtype.

    The row is cut into consecutive chunks of SUM_WIDTH lanes (the last one zero-padded); the chunks
    are added lane by lane in order, then the SUM_WIDTH lanes are folded pairwise (lane i with lane
    i + w/2). Only elementwise adds are used, and an elementwise add is exact IEEE arithmetic in the
    vectorised and the scalar loop alike, so no thread split or tail handling can change a bit.
    """
    length = x.shape[-1]
    if length == 0:
        return x.new_zeros(x.shape[:-1])
    kernels = _kernels_for(x)
    if kernels is not None and kernels.row_sum is not None and x.dtype == torch.float32:
        return kernels.row_sum(x.reshape(-1, length)).reshape(x.shape[:-1])
    width = SUM_WIDTH if length >= SUM_WIDTH else 1 << (length - 1).bit_length()
    padded = ceil_div(length, width) * width
    if padded != length:
        x = torch.nn.functional.pad(x, (0, padded - length))
    acc = x[..., 0:width]
    for start in range(width, padded, width):
        acc = acc + x[..., start:start + width]
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:2 * width]
    return acc[..., 0]


def row_max(x: Tensor) -> Tensor:
    """Max over the last dimension. Max is exact in any order, so torch's own kernel is invariant.

    NaN propagates (torch.amax returns NaN for a row holding one)."""
    return torch.amax(x, dim=-1)


class CpuKernels(NamedTuple):
    """A set of CPU kernels for the arithmetic whose bits a library may choose: the GEMMs of
    `matmul_rows` and `weight_grad` (same signatures), and `exp` and `log` (fp32 in, fp32 out; MKL's
    vector math gives them other bits under another instruction set). These, and `sqrt`, also take
    float64 (float64 out); the other forms are called for 16- and 32-bit floats alone. Optionally,
    faster forms of compositions whose bits are fixed here, which must give those bits: `row_sum` (fp32 [M, L] ->
    [M]), and `log_softmax` (fp32 [M, V] -> y) with its `log_softmax_backward` (g, y -> dx), the
    arithmetic of `log_softmax_rows` and `log_softmax_rows_backward` on their own exp and log;
    `lse_fold` and `logit_grad`, the LM head's per-chunk row arithmetic (same signatures; lse_fold's
    width included);
    `split_matmul_rows` (a, b, parts), the reduction over K in `parts` slices as `split_sum` of
    `matmul_rows` computes it; `silu` and `silu_backward` (same signatures); and `weight_grad_node`
    (grad_out, inp, bounds, out), `weight_grad_node`'s unit tree in one call, or None where it
    declines (then the composition runs); and `sqrt` (x, out=None), a correctly rounded square
    root, fp32 or float64 (MKL's vector math, which torch.sqrt takes, is not).
    `columns_at_any_width`: whether `matmul_rows` gives a column the same bits whatever the
    product's width (each dot computed by itself), so that a caller may take chunks of columns from
    one wider call."""
    name: str
    matmul_rows: Callable[..., Tensor]
    weight_grad: Callable[..., Tensor]
    exp: Callable[[Tensor], Tensor]
    log: Callable[[Tensor], Tensor]
    row_sum: Callable[[Tensor], Tensor] | None = None
    log_softmax: Callable[[Tensor], Tensor] | None = None
    log_softmax_backward: Callable[[Tensor, Tensor], Tensor] | None = None
    lse_fold: Callable[..., tuple[Tensor, Tensor]] | None = None
    logit_grad: Callable[..., Tensor] | None = None
    split_matmul_rows: Callable[[Tensor, Tensor, int], Tensor] | None = None
    silu: Callable[[Tensor], Tensor] | None = None
    silu_backward: Callable[[Tensor, Tensor], Tensor] | None = None
    weight_grad_node: Callable[[Tensor, Tensor, list[int], Tensor], Tensor | None] | None = None
    sqrt: Callable[..., Tensor] | None = None
    columns_at_any_width: bool = False


_CPU_KERNELS: dict[str, CpuKernels] = {}
_kernels_state = threading.local()


def register_cpu_kernels(kernels: CpuKernels) -> None:
    """Make `kernels` selectable by `cpu_kernels(kernels.name)` (the native backend registers its own)."""
    _CPU_KERNELS[kernels.name] = kernels


def current_cpu_kernels() -> str:
    """The CPU kernels selected for this thread: "torch" (PyTorch's, in fixed tiles) unless a
    `cpu_kernels` block says otherwise. Autograd Functions record it in forward and restore it in
    backward, which may run on another thread."""
    stack = getattr(_kernels_state, "stack", None)
    return stack[-1] if stack else "torch"


@contextlib.contextmanager
def cpu_kernels(name: str) -> Iterator[None]:
    """Run `matmul_rows`, `weight_grad`, `exp`, `log` and `sqrt` on CPU tensors with kernels `name`
    in the block."""
    if name != "torch" and name not in _CPU_KERNELS:
        raise ValueError(f"name: unknown CPU kernels {name!r}; expected one of {['torch', *_CPU_KERNELS]}")
    stack = getattr(_kernels_state, "stack", None)
    if stack is None:
        stack = _kernels_state.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def records_cpu_kernels(forward: Callable) -> Callable:
    """Decorator of an autograd Function's forward: remember the CPU kernels it ran with (see
    `restores_cpu_kernels`)."""
    @functools.wraps(forward)
    def wrapped(ctx, *args, **kwargs):
        ctx.cpu_kernels = current_cpu_kernels()
        return forward(ctx, *args, **kwargs)
    return wrapped


def restores_cpu_kernels(backward: Callable) -> Callable:
    """Decorator of an autograd Function's backward: run it on the CPU kernels its forward ran with,
    whichever thread autograd runs it on."""
    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        with cpu_kernels(ctx.cpu_kernels):
            return backward(ctx, *grads)
    return wrapped


def _kernels_for(t: Tensor, float64: bool = False) -> CpuKernels | None:
    """The selected kernels that take `t`, or None for PyTorch's own (any device but the CPU, none
    selected, or float64 where the caller's form is not one of the five that take it)."""
    name = current_cpu_kernels()
    if name == "torch" or t.device.type != "cpu" or (t.dtype == torch.float64 and not float64):
        return None
    return _CPU_KERNELS[name]


def columns_at_any_width(t: Tensor) -> bool:
    """Whether `matmul_rows` with `t` as its first operand gives each column of the product the same
    bits at any width: on the selected CPU kernels where they say so (the native ones), never on
    PyTorch's GEMMs, whose columns may follow the call's width (`torch_gemm_broken_premises`'s
    "column widths")."""
    kernels = _kernels_for(t)
    return kernels is not None and kernels.columns_at_any_width


class _OnKernels(torch.autograd.Function):
    """A CPU kernel's exp, log or sqrt, differentiable as torch's own: autograd's formulas for
    torch.exp, torch.log and torch.sqrt (grad * e^x, grad / x, grad / (2 sqrt x)), each an IEEE
    operation, so the gradient's bits are the machine's no more than the value's."""

    @staticmethod
    def forward(ctx, x: Tensor, name: str, kernel: Callable[[Tensor], Tensor]) -> Tensor:
        y = kernel(x)
        ctx.name = name
        ctx.save_for_backward(x if name == "log" else y)      # what the formula needs, as torch keeps
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        (saved,) = ctx.saved_tensors
        if ctx.name == "exp":
            return grad * saved, None, None
        if ctx.name == "log":
            return grad / saved, None, None
        return grad / (2 * saved), None, None


def _on_kernels(name: str, kernel: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """kernel(x), through `_OnKernels` where autograd records it (the kernels see plain data)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _OnKernels.apply(x, name, kernel)
    return kernel(x)


def exp(x: Tensor) -> Tensor:
    """torch.exp, on the selected CPU kernels when there are some for `x` (same dtype out;
    differentiable either way)."""
    kernels = _kernels_for(x, float64=True)
    return torch.exp(x) if kernels is None else _on_kernels("exp", kernels.exp, x)


def log(x: Tensor) -> Tensor:
    """torch.log, on the selected CPU kernels when there are some for `x` (same dtype out;
    differentiable either way)."""
    kernels = _kernels_for(x, float64=True)
    return torch.log(x) if kernels is None else _on_kernels("log", kernels.log, x)


def sqrt(x: Tensor, out: Tensor | None = None) -> Tensor:
    """torch.sqrt (into `out` when given), on the selected CPU kernels when there are some for `x`:
    then the correctly rounded root in float64 for float64 x and in fp32 otherwise, and `out` must
    be of that dtype and x's shape. Other devices take torch.sqrt (on the CPU, MKL's vector math).
    Differentiable either way; with `out`, x must not need a gradient (as torch.sqrt refuses it)."""
    kernels = _kernels_for(x, float64=True)
    if kernels is None or kernels.sqrt is None:
        return torch.sqrt(x, out=out)
    if out is None:
        return _on_kernels("sqrt", kernels.sqrt, x)
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("out: sqrt into out= does not support automatic differentiation, and x requires grad")
    return kernels.sqrt(x, out=out)


def rsqrt(x: Tensor) -> Tensor:
    """torch.rsqrt; on the selected CPU kernels, 1 / their correctly rounded root (what a kernel's
    1.0f / sqrtf gives), since ATen's float64 rsqrt follows the CPU's maker."""
    kernels = _kernels_for(x, float64=True)
    if kernels is None or kernels.sqrt is None:
        return torch.rsqrt(x)
    return torch.reciprocal(_on_kernels("sqrt", kernels.sqrt, x))


def silu(x: Tensor) -> Tensor:
    """x * (1 / (1 + exp(-x))) elementwise in the accumulation dtype, x's dtype out: torch.silu's
    value with bits that do not depend on an element's place in the loop. On the selected CPU
    kernels' fused form when there is one."""
    kernels = _kernels_for(x)
    if kernels is not None and kernels.silu is not None:
        return kernels.silu(x)
    return silu_composed(x)


def silu_composed(x: Tensor) -> Tensor:
    """`silu` as PyTorch ops (the fused forms must give its bits)."""
    xf = x.to(accumulate_dtype(x.dtype))
    return (xf * (1.0 / (1.0 + exp(-xf)))).to(x.dtype)


def silu_backward(grad_y: Tensor, x: Tensor) -> Tensor:
    """d silu(x) = grad_y * (s + x * s * (1 - s)), s = 1 / (1 + exp(-x)), in the accumulation
    dtype, x's dtype out. On the selected CPU kernels' fused form when there is one."""
    kernels = _kernels_for(x)
    if kernels is not None and kernels.silu_backward is not None:
        return kernels.silu_backward(grad_y, x)
    return silu_backward_composed(grad_y, x)


def silu_backward_composed(grad_y: Tensor, x: Tensor) -> Tensor:
    """`silu_backward` as PyTorch ops (the fused forms must give its bits)."""
    acc = accumulate_dtype(x.dtype)
    xf, dy = x.to(acc), grad_y.to(acc)
    s = 1.0 / (1.0 + exp(-xf))
    return (dy * (s + xf * s * (1.0 - s))).to(x.dtype)


def shifted_and_lse(x: Tensor) -> tuple[Tensor, Tensor]:
    """For rows x [M, V] (accumulation dtype): (x - exact row max, log row_sum(exp(x - max))) per row."""
    shifted = x - row_max(x)[:, None]
    return shifted, log(row_sum(exp(shifted)))


def log_softmax_rows(x: Tensor) -> Tensor:
    """log_softmax of each row of x [M, V] (accumulation dtype): shifted = x - (exact row max), then
    shifted - log(row_sum(exp(shifted))). On the selected CPU kernels' fused form when they have one
    (the same bits; one pass over memory instead of several)."""
    kernels = _kernels_for(x)
    if kernels is not None and kernels.log_softmax is not None and x.dtype == torch.float32:
        return kernels.log_softmax(x)
    shifted, lse = shifted_and_lse(x)
    return shifted - lse[:, None]


def log_softmax_rows_backward(g: Tensor, y: Tensor) -> Tensor:
    """The gradient of `log_softmax_rows` from its output y and the output's gradient g (both [M, V],
    accumulation dtype): g - exp(y) * row_sum(g). On the fused form when the kernels have one."""
    kernels = _kernels_for(g)
    if kernels is not None and kernels.log_softmax_backward is not None and g.dtype == torch.float32:
        return kernels.log_softmax_backward(g, y)
    return g - exp(y) * row_sum(g)[:, None]


def scaled_logits(chunk: Tensor, temperature: float) -> Tensor:
    """A chunk of logits [T, L] (the LM head GEMM's dtype) in the accumulation dtype, divided by the
    temperature (not at 1)."""
    x = chunk.to(accumulate_dtype(chunk.dtype))
    return x if temperature == 1.0 else x / temperature


def lse_fold(chunk: Tensor, temperature: float, run: tuple[Tensor, Tensor] | None,
             width: int | None = None) -> tuple[Tensor, Tensor]:
    """One step of the LM head's online log-sum-exp over vocabulary chunks. chunk: logits [T, L] in
    the GEMM's dtype, scaled here (`scaled_logits`); run: (running max, running sum) [T] in the
    accumulation dtype, None at the first chunk. Returns the new (max, sum):

        m = max(run max, row_max(x)); s = run sum * exp(run max - m) + row_sum(exp(x - m)),

    at the first chunk m = row_max(x) and s = row_sum(exp(x - m)). width: take `chunk` as several
    chunks, its consecutive pieces of `width` columns (the last may be shorter), folded one after
    another. On the selected CPU kernels' fused form when they have one (the same bits, one pass
    over the logits, one call for all the pieces)."""
    if width is not None and width < 1:
        raise ValueError(f"width: expected a positive number of columns, got {width}")
    kernels = _kernels_for(chunk)
    if kernels is not None and kernels.lse_fold is not None and chunk.dim() == 2:
        return kernels.lse_fold(chunk, temperature, run, width)
    if width is not None and width < chunk.shape[-1]:
        for start in range(0, chunk.shape[-1], width):
            run = lse_fold(chunk[..., start:start + width], temperature, run)
        return run
    x = scaled_logits(chunk, temperature)
    chunk_max = row_max(x)
    if run is None:
        return chunk_max, row_sum(exp(x - chunk_max[:, None]))
    run_max, run_sum = run
    new_max = torch.maximum(run_max, chunk_max)
    return new_max, run_sum * exp(run_max - new_max) + row_sum(exp(x - new_max[:, None]))


def logit_grad(chunk: Tensor, temperature: float, lse: Tensor, local: Tensor, inside: Tensor, scale: Tensor,
               out_dtype: torch.dtype) -> Tensor:
    """The gradient of scale * log p(target) with respect to a chunk's scaled logits x
    (`scaled_logits` of chunk [T, L], the GEMM's dtype): d = -exp(x - lse), plus `inside` at column
    `local`, times scale; in out_dtype. lse, inside (1 where the row's target lies in the chunk,
    else 0) and scale: [T], accumulation dtype; local: [T] int64 in [0, L). On the selected CPU
    kernels' fused form when they have one (the same bits)."""
    kernels = _kernels_for(chunk)
    if (kernels is not None and kernels.logit_grad is not None and chunk.dim() == 2
            and out_dtype in (torch.float32, torch.bfloat16)):
        return kernels.logit_grad(chunk, temperature, lse, local, inside, scale, out_dtype)
    d = -exp(scaled_logits(chunk, temperature) - lse[:, None])
    d.scatter_(1, local[:, None], d.gather(1, local[:, None]) + inside[:, None])
    return (d * scale[:, None]).to(out_dtype)


def matmul_rows(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a @ b (+ bias), row-invariant: a [M, K], b [K, N] (may be a transposed view), bias [N];
    or batched: a [B, M, K], b [B, K, N]. Returns [(B,) M, N] in a's dtype. On the selected CPU
    kernels (`cpu_kernels`) when there are some for `a`, else by `torch_matmul_rows`."""
    kernels = _kernels_for(a, float64=True)
    if kernels is not None:
        return kernels.matmul_rows(a, b, bias)
    return torch_matmul_rows(a, b, bias)


def torch_matmul_rows(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a @ b (+ bias) through PyTorch's GEMMs, row-invariant: a [M, K], b [K, N] (may be a transposed view), bias [N];
    or batched: a [B, M, K], b [B, K, N].

    The rows of `a` are processed in tiles of exactly ROW_TILE rows, the tail in the `tail_tiles`
    shapes, largest first; rows that fill more than 3/4 of a tile (or fewer than the smallest) are
    zero-padded to it. In fp32 on a CPU the columns go in COLUMN_CHUNK-column calls. So each BLAS
    call has one of a few fixed shapes and a row's result never depends on M or on its position.
    bf16 runs natively (fp32 accumulation in oneDNN);
    fp16 is computed in fp32 because CPUs without fp16 arithmetic are faster and exact that way.
    The bias is added inside the GEMM (addmm) so the result is rounded once. Returns [(B,) M, N]
    in a's dtype.
    """
    out_dtype = a.dtype
    if a.dtype == torch.float16 and a.device.type == "cpu":
        a, b = a.float(), b.float()
        bias = None if bias is None else bias.float()
    batched = a.dim() == 3
    n = b.shape[-1]
    # fp32 CPU GEMMs with many columns run in COLUMN_CHUNK-column calls: MKL's fp32 kernels are
    # faster so (up to 1.9x for an 8-row tile against a 152k vocabulary), and bf16's are not. The
    # bits are those of one call.
    columns = COLUMN_CHUNK if a.dtype == torch.float32 and a.device.type == "cpu" and not batched else n

    def gemm(rows: Tensor, out: Tensor | None = None) -> Tensor:
        if batched:
            return torch.bmm(rows, b, out=out)
        if out is None:
            out = rows.new_empty((rows.shape[0], n))
        for c in range(0, max(n, 1), columns):
            e = min(n, c + columns)
            if bias is None:
                torch.mm(rows, b[:, c:e], out=out[:, c:e])
            else:
                torch.addmm(bias[c:e], rows, b[:, c:e], out=out[:, c:e])
        return out

    a = a.contiguous()
    m, k = a.shape[-2], a.shape[-1]
    lead = a.shape[:-2]
    out = a.new_empty(lead + (m, b.shape[-1]))
    # Every tile computes in a's dtype: autocast would cast the tiles called without `out=` (the
    # padded ones) and not the others, so a row's bits would depend on its tile. The ops decide the
    # dtype under autocast before they get here.
    tails = tail_tiles(a.dtype, a.device)
    with torch.autocast(a.device.type, enabled=False):
        start = 0
        while start < m:
            rest = m - start
            tile = next((t for t in (ROW_TILE,) + tails if rest >= t or 4 * rest > 3 * t), tails[-1])
            if rest >= tile:
                gemm(a[..., start:start + tile, :], out=out[..., start:start + tile, :])
                start += tile
            else:
                padded = a.new_zeros(lead + (tile, k))
                padded[..., :rest, :] = a[..., start:, :]
                out[..., start:, :] = gemm(padded)[..., :rest, :]
                start = m
    return out.to(out_dtype)


def torch_gemm_broken_premises() -> tuple[str, ...]:
    """Which premises of the portable backend's invariance PyTorch's fp32 CPU GEMM breaks at this
    thread count (docs/contract.md, section 7): "row tiles" where a row's bits differ between the
    row tiles `torch_matmul_rows` uses (batch invariance rests on it), "column widths" where a
    column's bits follow the call's width (COLUMN_CHUNK's calls and tensor-parallel shards rest on
    it). MKL on an Intel CPU without AVX-512 breaks both, and on a 2-core AVX-512 Xeon at 2 threads
    the row tiles (ADR 0026). A probe of a few shapes, called as linear calls them (the weight a
    transposed view): a premise it names broken is broken; one it passes is what `lockstep check
    --backend portable` and tests/test_portable.py test further."""
    return _gemm_broken_premises(torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _gemm_broken_premises(threads: int) -> tuple[str, ...]:
    return gemm_broken_premises(torch.mm)


def gemm_broken_premises(mm: Callable[[Tensor, Tensor], Tensor]) -> tuple[str, ...]:
    """`torch_gemm_broken_premises`'s probe of a given fp32 GEMM mm(a [M, K], b [K, N]) -> [M, N],
    at the current thread count: so a test can ask what the probe should see of an arithmetic it
    spells out."""
    gen = torch.Generator().manual_seed(0)

    def products(m: int, k: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
        a, b = torch.randn(m, k, generator=gen), (torch.randn(n, k, generator=gen) / 32).t()
        return a, b, mm(a, b)

    rows = columns = True
    # The probe may first run inside an op under autocast; its answer is about fp32 GEMMs.
    with torch.autocast("cpu", enabled=False):
        for k, n in ((300, 77), (1024, 1024)):
            a, b, full = products(ROW_TILE, k, n)
            rows = rows and all(torch.equal(mm(a[:t], b), full[:t]) for t in TAIL_TILES)
        for k, n in ((300, 77), (1024, COLUMN_CHUNK + 1904)):
            a, b, full = products(TAIL_TILE, k, n)
            parts = [(0, n // 2), (n // 2, n)] + ([(0, COLUMN_CHUNK), (COLUMN_CHUNK, n)] if n > COLUMN_CHUNK else [])
            columns = columns and all(torch.equal(mm(a, b[:, lo:hi]), full[:, lo:hi]) for lo, hi in parts)
    return tuple(name for name, kept in (("row tiles", rows), ("column widths", columns)) if not kept)


def sum_over_rows(rows: int, block_partial: Callable[[int, int], Tensor]) -> Tensor:
    """Sum of per-row contributions in the documented fixed order.

    block_partial(start, stop) returns the fixed-shape partial of rows [start, stop) of one block of
    ROW_BLOCK rows (the caller zero-pads the block). Partials are added in block order, starting
    from the first block. Returns the accumulated tensor (the caller's accumulation dtype).
    """
    total = None
    for start in range(0, max(rows, 1), ROW_BLOCK):
        part = block_partial(start, min(start + ROW_BLOCK, rows))
        total = part if total is None else total + part
    return total


def padded_block(x: Tensor, start: int, stop: int, rows: int = ROW_BLOCK) -> Tensor:
    """Rows [start, stop) of the second-to-last dimension (the first for 1-D/2-D tensors),
    zero-padded to `rows` rows (ROW_BLOCK by default)."""
    dim = 0 if x.dim() <= 2 else x.dim() - 2
    block = x.narrow(dim, start, stop - start)
    if stop - start == rows:
        return block
    shape = list(x.shape)
    shape[dim] = rows
    out = x.new_zeros(shape)
    out.narrow(dim, 0, stop - start).copy_(block)
    return out


def weight_grad(grad_out: Tensor, inp: Tensor, out: Tensor | None = None) -> Tensor:
    """sum over rows r of grad_out[r]^T inp[r]: [M, N], [M, K] -> [N, K]; batched: [B, M, N],
    [B, M, K] -> [B, N, K]; in the accumulation dtype, into `out` when given. On the selected CPU
    kernels when there are some for `grad_out`, else by `torch_weight_grad`."""
    kernels = _kernels_for(grad_out, float64=True)
    if kernels is not None:
        return kernels.weight_grad(grad_out, inp, out)
    return torch_weight_grad(grad_out, inp, out)


# pairwise_weight_grad's leaf: 16 rows were twice as exact again and cost 1.43x the old attention
# backward, where 32 cost 1.21x (docs/adr/0033).
LEAF_ROWS = 32
# Leaves multiplied at a time. A power of two, so each chunk is a whole subtree of the pairwise fold
# and chunking changes no bit; it bounds the products held at once to 64 [N, K] per batch entry (all
# of them are 268 MB per query head of a KV group at 32k query rows, 8 KV heads and head dim 128).
CHUNK_LEAVES = 64


def pairwise_weight_grad(grad_out: Tensor, inp: Tensor) -> Tensor:
    """sum over rows r of grad_out[b, r]^T inp[b, r]: [B, M, N], [B, M, K] -> [B, N, K], in the
    accumulation dtype, for sums over a few hundred rows that must be as exact as the BLAS's own.

    Each LEAF_ROWS rows (the last zero-padded) are one product, every leaf of one shape, batched
    into GEMMs CHUNK_LEAVES leaves at a time (on the selected CPU kernels when there are some); the
    leaves are then added pairwise, neighbours first, an odd last one passed up a level. The order
    depends on M alone. weight_grad's 128-row blocks are each summed in one chain on some BLASes
    (MKL's GEMM at these shapes), which put attention's dk and dv, sums over queries, at up to 2.6x
    eager PyTorch's error (docs/adr/0033)."""
    if grad_out.dim() != 3 or inp.dim() != 3:
        raise ValueError(f"grad_out, inp: expected 3-D tensors [B, M, N] and [B, M, K], got shapes "
                         f"{tuple(grad_out.shape)} and {tuple(inp.shape)}")
    if grad_out.shape[:2] != inp.shape[:2]:
        raise ValueError(f"inp: expected the batch and row counts of grad_out, {tuple(grad_out.shape[:2])}, "
                         f"got {tuple(inp.shape[:2])}")
    acc = accumulate_dtype(grad_out.dtype)
    b, m, n = grad_out.shape
    k = inp.shape[-1]
    leaves = max(1, -(-m // LEAF_ROWS))
    if leaves * LEAF_ROWS != m:
        grad_out = torch.cat([grad_out, grad_out.new_zeros(b, leaves * LEAF_ROWS - m, n)], 1)
        inp = torch.cat([inp, inp.new_zeros(b, leaves * LEAF_ROWS - m, k)], 1)
    g_leaves = grad_out.reshape(b, leaves, LEAF_ROWS, n)
    x_leaves = inp.reshape(b, leaves, LEAF_ROWS, k)
    kernels = _kernels_for(grad_out, float64=True)
    chunk_sums = []
    for start in range(0, leaves, CHUNK_LEAVES):
        count = min(CHUNK_LEAVES, leaves - start)
        g = g_leaves[:, start:start + count].reshape(b * count, LEAF_ROWS, n).to(acc).contiguous()
        x = x_leaves[:, start:start + count].reshape(b * count, LEAF_ROWS, k).to(acc).contiguous()
        # One fixed GEMM shape (LEAF_ROWS terms) for every leaf, so torch's needs no padding to ROW_BLOCK.
        part = kernels.weight_grad(g, x) if kernels is not None else torch.bmm(g.transpose(1, 2), x)
        chunk_sums.append(_pairwise_sum(part.view(b, count, n, k)))
    return _pairwise_sum(torch.stack(chunk_sums, 1))


def _pairwise_sum(part: Tensor) -> Tensor:
    """part[:, 0] + part[:, 1] + ... added pairwise, neighbours first, an odd last one passed up a
    level: [B, L, N, K] -> [B, N, K]."""
    while part.shape[1] > 1:
        pairs = part.shape[1] // 2
        merged = part[:, 0:2 * pairs:2] + part[:, 1:2 * pairs:2]
        part = merged if part.shape[1] % 2 == 0 else torch.cat([merged, part[:, -1:]], 1)
    return part[:, 0]


# The LM head's weight-gradient blocks on PyTorch's GEMMs (docs/adr/0034): 128-row blocks, each one
# chain on MKL, left it at 3.5x eager PyTorch's error; 32 were within eager's at 1.02-1.03x the time.
LM_HEAD_ROW_BLOCK = 32


def lm_head_weight_grad(grad_out: Tensor, inp: Tensor, out: Tensor | None = None) -> Tensor:
    """`weight_grad` of the LM head, grad_out [M, N] (the logits' gradient) and inp [M, K]: on the
    selected CPU kernels exactly `weight_grad`; on PyTorch's GEMMs, `torch_weight_grad`'s order in
    LM_HEAD_ROW_BLOCK-row blocks. Its sum over rows is one large-valued gradient (a target's
    column gathers a whole 1 per row that picks it), where each block's chain is most of the error."""
    if _kernels_for(grad_out, float64=True) is not None:
        return weight_grad(grad_out, inp, out)
    return torch_weight_grad(grad_out, inp, out, rows_per_block=LM_HEAD_ROW_BLOCK)


def torch_weight_grad(grad_out: Tensor, inp: Tensor, out: Tensor | None = None,
                      rows_per_block: int = ROW_BLOCK) -> Tensor:
    """sum over rows r of grad_out[r]^T inp[r], in fixed row blocks: [M, N], [M, K] -> [N, K];
    batched: [B, M, N], [B, M, K] -> [B, N, K]. In the accumulation dtype; into `out` (a
    contiguous tensor of that shape and dtype, overwritten) when given.

    Block by block from row 0, one GEMM of fixed shape [N, R] @ [R, K], R = rows_per_block
    (ROW_BLOCK unless the caller fixes another): the first writes the accumulator
    (out <- G_0^T X_0), each next one adds into it in place (addmm with beta = 1:
    out <- out + G_b^T X_b). The last block is zero-padded, so zero-gradient rows appended
    to the batch add exact zeros. Writing the first block, rather than adding it to zeros, spares a
    pass over the accumulator (a vocabulary-sized one for the LM head).
    """
    acc = accumulate_dtype(grad_out.dtype)
    rows = grad_out.shape[-2]
    shape = tuple(grad_out.shape[:-2]) + (grad_out.shape[-1], inp.shape[-1])
    if out is None:
        out = grad_out.new_empty(shape, dtype=acc)
    elif out.shape != shape or out.dtype != acc or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {acc} tensor of shape {shape}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if rows == 0:
        return out.zero_()
    for start in range(0, rows, rows_per_block):
        stop = min(start + rows_per_block, rows)
        g = padded_block(grad_out, start, stop, rows_per_block).to(acc).transpose(-1, -2)
        x = padded_block(inp, start, stop, rows_per_block).to(acc)
        if start == 0:
            (torch.bmm if out.dim() == 3 else torch.mm)(g, x, out=out)
        elif out.dim() == 3:
            torch.baddbmm(out, g, x, out=out)
        else:
            torch.addmm(out, g, x, out=out)
    return out


def column_sum(x: Tensor) -> Tensor:
    """sum over rows of x [M, N] -> [N] in the accumulation dtype, in fixed row blocks.

    Within a block the ROW_BLOCK rows are folded pairwise with elementwise adds (exact in every code
    path); blocks are added in order.
    """
    x = x.to(accumulate_dtype(x.dtype))

    def block(start: int, stop: int) -> Tensor:
        b = padded_block(x, start, stop)
        width = ROW_BLOCK
        while width > 1:
            width //= 2
            b = b[:width] + b[width:2 * width]
        return b[0]

    return sum_over_rows(x.shape[0], block)


def reduce_losses(loss: Tensor, count: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """Per-row losses [rows] (0 at ignored rows) -> cross_entropy's output: as they are ("none"),
    their fixed-order sum ("sum") or that sum over the non-ignored count ("mean"). Every backend's
    cross_entropy reduces through this, so the sum's order is the same on all of them."""
    if reduction == "none":
        return loss.to(dtype)
    total = column_sum(loss[:, None])[0]
    if reduction == "mean":
        total = total / count.to(total.dtype)
    return total.to(dtype)


def row_scale(grad: Tensor, reduction: str, count: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """d loss / d (row loss) for each row [rows]: grad itself ("none"), grad / count ("mean") or
    grad ("sum"); the backward of `reduce_losses`."""
    if reduction == "none":
        return grad.contiguous().to(dtype)
    if reduction == "mean":
        return (grad.to(dtype) / count.to(dtype)).expand(rows).contiguous()
    return grad.to(dtype).expand(rows).contiguous()


def _siblings(left: tuple[int, int, Tensor], right: tuple[int, int, Tensor]) -> bool:
    """Whether two adjacent pieces are the two halves of one node of the canonical tree."""
    return left[1] == right[1] and left[0] % (2 * left[1]) == 0 and right[0] == left[0] + left[1]


def tree_node_into(out: Tensor, leaves: int, spare: list[Tensor], leaf: Callable[[int, Tensor], Tensor]) -> Tensor:
    """`out` = the canonical tree's node over `leaves` leaves (a power of two): each node is left +
    right, as TreeSum forms it. leaf(i, buffer) writes leaf i into `buffer` (a contiguous tensor of
    out's shape) and returns it. Leaves are made in order and merged as their siblings arrive, so at
    most log2(leaves) + 1 buffers are live; they come from `spare` when they fit (out's shape or
    larger in the first dimension) and go back to it for the next call."""
    if leaves == 1:
        return leaf(0, out)
    stack: list[tuple[int, Tensor]] = []          # (size, buffer) of the nodes not yet merged
    for i in range(leaves):
        fits = spare and spare[-1].shape[0] >= out.shape[0] and spare[-1].shape[1:] == out.shape[1:]
        base = spare.pop() if fits else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        node, size = leaf(i, base[:out.shape[0]]), 1
        while stack and stack[-1][0] == size:
            left_base = stack.pop()[1]
            left = left_base[:out.shape[0]]
            if i == leaves - 1 and not stack:
                node = torch.add(left, node, out=out)
                spare.extend([left_base, base])
                return out
            node = left.add_(node)
            spare.append(base)
            base, size = left_base, 2 * size
        stack.append((size, base))
    raise ValueError(f"leaves: expected a power of two, got {leaves}")


def weight_grad_node(grad_out: Tensor, inp: Tensor, bounds: list[int], out: Tensor, spare: list[Tensor],
                     leaf: Callable[..., Tensor] | None = None) -> Tensor:
    """`out` = the canonical tree's node over the units whose rows of grad_out [M, N] and inp [M, K]
    are bounds[u] .. bounds[u + 1] (from 0 to M; a power of two of units), each unit's leaf its own
    `leaf(grad_out_rows, inp_rows, out=buffer)` (`weight_grad` by default; one whose bits on the
    CPU kernels are weight_grad's, such as lm_head_weight_grad): what grad_tree's unit tree makes of
    the units' partials. out: the accumulation dtype, [N, K], contiguous. On the selected CPU
    kernels' one-call form when they have one, else by `tree_node_into` (whose buffers come from and
    go back to `spare`)."""
    leaf = leaf or weight_grad
    if len(bounds) == 2:
        return leaf(grad_out, inp, out=out)
    kernels = _kernels_for(grad_out)
    if kernels is not None and kernels.weight_grad_node is not None and grad_out.dim() == 2:
        node = kernels.weight_grad_node(grad_out, inp, bounds, out)
        if node is not None:
            return node
    return tree_node_into(out, len(bounds) - 1, spare, lambda i, buffer: leaf(
        grad_out[bounds[i]:bounds[i + 1]], inp[bounds[i]:bounds[i + 1]], out=buffer))


class TreeSum:
    """A sum over the indices 0, 1, ..., n-1 in one canonical tree, fed in index order.

    The tree: node [k 2^j, (k+1) 2^j) = node of its left half + node of its right half, for every
    aligned power-of-two block that fits in [0, n); the maximal blocks that remain (the binary digits
    of n, largest first) are then added left to right. `add(start, size, value)` takes a leaf
    (size 1) or an aligned block that was summed elsewhere by the same tree (a piece); pieces are
    merged as soon as their sibling arrives, so at most about 2 log2(n) are held. Every node is one
    elementwise add of its two halves, so the result does not depend on which process or call
    computed which piece: only on the values of the leaves.
    """

    def __init__(self) -> None:
        self.pieces: list[tuple[int, int, Tensor]] = []
        self._owned: set[int] = set()      # ids of the node tensors no caller holds (added into in place)
        self._spare: Tensor | None = None  # a freed node tensor, for `spare` to hand out

    @property
    def stop(self) -> int | None:
        """The index after the last one added (None when empty)."""
        return self.pieces[-1][0] + self.pieces[-1][1] if self.pieces else None

    def add(self, start: int, size: int, value: Tensor, donated: bool = False) -> None:
        """Add a leaf or piece. `donated`: no caller holds `value`, so the tree may add into it in
        place and hand it out again from `spare` once it is merged away (a vocabulary-sized partial
        then costs no fresh allocation, whose page faults cost more than the add)."""
        if self.pieces and start != self.stop:
            raise ValueError(f"start: expected the next index {self.stop}, got {start} (indices must come in order)")
        if size < 1 or size & (size - 1) or start % size:
            raise ValueError(f"size: expected an aligned power-of-two block, got [{start}, {start + size})")
        self.pieces.append((start, size, value))
        if donated and isinstance(value, Tensor):
            self._owned.add(id(value))
        while len(self.pieces) >= 2 and _siblings(self.pieces[-2], self.pieces[-1]):
            right = self.pieces.pop()[2]
            start_left, size_left, left = self.pieces.pop()
            # Every node is left + right, in that operand order, wherever it is written.
            if id(left) in self._owned:
                node = left.add_(right)
                if id(right) in self._owned:
                    self._owned.discard(id(right))
                    self._spare = right
            elif id(right) in self._owned:
                node = torch.add(left, right, out=right)
            else:
                node = left + right
                if isinstance(node, Tensor):
                    self._owned.add(id(node))
            self.pieces.append((start_left, 2 * size_left, node))

    def spare(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised tensor for the next leaf: the last node tensor merged away when it fits,
        else a new one. Donate it back with `add(..., donated=True)`."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.shape == tuple(shape) and spare.dtype == dtype and spare.device == device:
            return spare
        return torch.empty(shape, dtype=dtype, device=device)

    def total(self) -> Tensor:
        """The sum; the pieces must cover [0, n) (n = `stop`)."""
        if not self.pieces or self.pieces[0][0] != 0:
            raise ValueError("TreeSum: the pieces do not start at index 0")
        self._spare = None
        out = self.pieces[0][2]
        for _, _, value in self.pieces[1:]:
            out = out + value
        return out


def pieces_of(start: int, stop: int) -> list[tuple[int, int]]:
    """The (start, size) pieces a TreeSum fed the leaves start..stop-1 holds at the end."""
    t = TreeSum()
    for i in range(start, stop):
        t.add(i, 1, 0)  # type: ignore[arg-type]  # only the shape of the tree matters here
    return [(s, n) for s, n, _ in t.pieces]


def tree_sum(parts: list[Tensor]) -> Tensor:
    """Sum of parts[0], parts[1], ... by the canonical tree over their index (TreeSum)."""
    t = TreeSum()
    for i, p in enumerate(parts):
        t.add(i, 1, p)
    return t.total()


def split_sum(part: Callable[[int, int], Tensor], length: int, parts: int) -> Tensor:
    """A reduction over a dimension of `length`, cut into `parts` equal slices: part(start, stop)
    reduces one slice; the slices combine by the canonical tree. parts == 1 calls part(0, length)."""
    if length % parts:
        raise ValueError(f"parts: {parts} does not divide the reduced length {length}")
    size = length // parts
    return tree_sum([part(i * size, (i + 1) * size) for i in range(parts)])


def split_matmul_rows(a: Tensor, b: Tensor, parts: int) -> Tensor:
    """a @ b with the reduction over K cut into `parts` slices (`split_sum` of `matmul_rows`): a
    [M, K], b [K, N] (a transposed view is free) -> [M, N] in a's dtype, each slice's product
    rounded to it and the slices summed by the canonical tree in it. The selected CPU kernels may
    do this in one call, with these bits."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a, b: expected [M, K] and [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if parts == 1:
        return matmul_rows(a, b)
    kernels = _kernels_for(a)
    if kernels is not None and kernels.split_matmul_rows is not None:
        return kernels.split_matmul_rows(a, b, parts)
    return split_sum(lambda s, e: matmul_rows(a[:, s:e], b[s:e]), a.shape[-1], parts)
