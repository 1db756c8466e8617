"""The mode's attention: scaled_dot_product_attention with any causal, boolean or 0/-inf mask,
through the registry's `masked_attention` op (lockstep's fixed 64-key blocks re-anchored at each
query's first visible key), in every form torch picks: on a CPU its flash kernel, on CUDA the flash,
memory-efficient, cuDNN and math forms. `visible_mask` turns SDPA's arguments into the op's mask;
`overrides(backend)` maps the aten ops to their kernels."""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import Tensor

from .. import ops, registry


def visible_mask(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """[B, Lq, Lk] bool from SDPA's arguments; the mask must not differ between heads."""
    b, lq, lk = q.shape[0], q.shape[-2], k.shape[-2]
    vis = torch.ones((b, lq, lk), dtype=torch.bool, device=q.device)
    if is_causal:
        vis &= torch.ones((lq, lk), dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        m = attn_mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        if m.shape[1] != 1 and not bool((m == m[:, :1]).all()):
            raise NotImplementedError("lockstep attention: attn_mask: expected one mask for all heads, got one that "
                                      "differs between heads")
        m = m[:, 0].expand(b, lq, lk)
        if m.dtype == torch.bool:
            vis &= m
        else:
            masked = m <= torch.finfo(m.dtype).min / 2
            if not bool(((m == 0) | masked).all()):
                raise NotImplementedError("lockstep attention: attn_mask: expected a bool mask or a float mask of "
                                          "only 0 and -inf (or the dtype's minimum); additive biases are not supported")
            vis &= ~masked
    return vis


def _default_scale(q: Tensor, scale) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _empty(q: Tensor, dtype: torch.dtype = torch.int64) -> Tensor:
    return torch.empty(0, dtype=dtype, device=q.device)


def overrides(backend: str | None) -> dict[str, Callable]:
    """SDPA's aten forms -> kernels that run `ops.masked_attention` on `backend` (None: whatever the
    registry selects for the tensors). Each returns what its aten form returns; a kernel that returns
    None (dropout, a debug mask) leaves the call to the stock kernel. The logsumexp that the CUDA
    forms return is the op's, [B, Hq, Lq] float32, whatever shape the stock kernel gives it; their
    backward forms take it back and do not read it. `_scaled_dot_product_attention_math` is
    composite: its kernel is registered at the autograd key and returns its autograd graph's output,
    with an empty tensor for the attention weights that SDPA discards."""

    def backend_block():
        return registry.use_backend(backend) if backend is not None else contextlib.nullcontext()

    def attend(query, key, value, attn_mask, is_causal, scale):
        with backend_block():
            return ops.masked_attention(query, key, value, visible_mask(query, key, attn_mask, is_causal),
                                        _default_scale(query, scale))

    def gradients(grad_out, query, key, value, attn_mask, is_causal, scale):
        """dq, dk, dv by autograd through the same op (its backward recomputes the statistics, so the
        forward saved by aten is not needed; recomputing it costs one more forward)."""
        visible = visible_mask(query, key, attn_mask, is_causal)
        with torch.enable_grad(), backend_block():
            q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
            o, _ = ops.masked_attention(q, k, v, visible, _default_scale(query, scale))
            return torch.autograd.grad(o, (q, k, v), grad_out)

    def flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        if dropout_p > 0:
            return None
        return attend(query, key, value, attn_mask, is_causal, scale)

    def flash_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None,
                           scale=None):
        return gradients(grad_out, query, key, value, attn_mask, is_causal, scale)

    def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=None):
        if dropout_p > 0 or return_debug_mask:
            return None
        out, lse = attend(query, key, value, None, is_causal, scale)
        return (out, lse, _empty(query, torch.int32), _empty(query, torch.int32), query.shape[2], key.shape[2],
                _empty(query), _empty(query), _empty(query, query.dtype))

    def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                       is_causal, philox_seed, philox_offset, scale=None):
        return gradients(grad_out, query, key, value, None, is_causal, scale)

    def efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, scale=None):
        if dropout_p > 0:
            return None
        out, lse = attend(query, key, value, attn_bias, is_causal, scale)
        return out, (lse if compute_log_sumexp else lse[..., :0]), _empty(query), _empty(query)

    def efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                           dropout_p, grad_input_mask, is_causal=False, scale=None):
        if grad_input_mask[3]:
            raise NotImplementedError("lockstep.batch_invariant: attn_bias: expected a mask that needs no gradient "
                                      "(bool, or float of 0 and -inf), got one whose gradient is asked for")
        dq, dk, dv = gradients(grad_out, query, key, value, attn_bias, is_causal, scale)
        return dq, dk, dv, _empty(query, query.dtype)

    def cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
              return_debug_mask=False, scale=None):
        if dropout_p > 0 or return_debug_mask:
            return None
        out, lse = attend(query, key, value, attn_bias, is_causal, scale)
        return (out, lse, _empty(query, torch.int32), _empty(query, torch.int32), query.shape[2], key.shape[2],
                _empty(query), _empty(query), _empty(query, query.dtype))

    def cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                       cum_seq_k, max_q, max_k, dropout_p, is_causal, scale=None):
        return gradients(grad_out, query, key, value, attn_bias, is_causal, scale)

    return {
        "_scaled_dot_product_flash_attention_for_cpu": flash_cpu,
        "_scaled_dot_product_flash_attention_for_cpu_backward": flash_cpu_backward,
        "_scaled_dot_product_flash_attention": flash,
        "_scaled_dot_product_flash_attention_backward": flash_backward,
        "_scaled_dot_product_efficient_attention": efficient,
        "_scaled_dot_product_efficient_attention_backward": efficient_backward,
        "_scaled_dot_product_cudnn_attention": cudnn,
        "_scaled_dot_product_cudnn_attention_backward": cudnn_backward,
    }


def math_override(backend: str | None) -> Callable:
    """The kernel of `_scaled_dot_product_attention_math` at the autograd key (it is composite, so
    no backend key reaches it): (out, an empty tensor for the attention weights), differentiable
    through `ops.masked_attention` on `backend`. None (dropout) leaves the call to the stock kernel."""

    def math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, dropout_mask=None, scale=None,
             enable_gqa=False):
        if dropout_p > 0 or dropout_mask is not None:
            return None
        with registry.use_backend(backend) if backend is not None else contextlib.nullcontext():
            out, _ = ops.masked_attention(query, key, value, visible_mask(query, key, attn_mask, is_causal),
                                          _default_scale(query, scale))
        return out, _empty(query, query.dtype)

    return math


OVERRIDES = overrides(None)
