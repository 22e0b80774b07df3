"""Softmax with a per-head attention sink on ``scaled_dot_product_attention``, without the
(B, H, Nq, Nk) logits.

The sink normaliser is p_i = e^{z_i} / (e^{b_h} + Σ_j e^{z_j}): one more logit per row, b_h, whose
key carries no value (gpt-oss; HF transformers ``modeling_gpt_oss.py`` concatenates the sinks to
the logits and drops their column after the softmax).  That is ordinary softmax attention over one
extra key whose value is zero and whose logit is b_h for every query.  SDPA adds an additive mask
after the scale, so a per-head bias on that column would need an (H, Nq, Nk + 1) float mask, as
large as the logits; instead the bias rides on one extra coordinate of q and k::

    q' = [scale · q, b_h - o, 0...]      k'_j = [k_j, 0, 0...]      k'_sink = [0, 1, 0...]

so q'·k'_j = scale · q·k_j and q'·k'_sink = b_h - o (o: a per-row logit offset, which the softmax
over the real keys alone would cancel but the sink does not).  The head size is padded to a
multiple of 8, which the fused CUDA kernels require; extra memory is O(N · d), and the gradient
reaches b_h through q'.  A row whose keys are all masked attends only the sink: zero output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# SDPA's fused CUDA kernels need the head size to be a multiple of 8.
HEAD_MULTIPLE = 8


def sink_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, sink: Tensor,
                   offset: float | Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """softmax([scale · q kᵀ + o, b_h]) without its last column, times v: (B, H, Nq, d_v).

    q, k (B, H, N·, d) float32 or float64 (v of a half type runs SDPA in that type, which
    accumulates in float32); ``sink`` (H,) the per-head sink logits b_h; ``offset`` a float or
    a tensor broadcastable to (B, H, Nq, 1); ``mask`` boolean (True = attend) broadcastable to
    (B, H, Nq, Nk), or None; ``causal`` top-left.
    """
    b, h, n_q, d = q.shape
    n_k = k.shape[-2]
    pad = -(d + 1) % HEAD_MULTIPLE
    bias = sink.to(q.dtype).view(1, h, 1, 1) - offset                    # (1|B, H, 1|Nq, 1)
    extra = q.new_zeros(b, h, n_q, 1 + pad)
    extra[..., :1] = bias
    q2 = torch.cat([q * scale, extra], dim=-1)                            # (B, H, Nq, d')
    k_sink = k.new_zeros(b, h, 1, d + 1 + pad)
    k_sink[..., d] = 1.0
    k2 = torch.cat([torch.cat([k, k.new_zeros(b, h, n_k, 1 + pad)], dim=-1), k_sink], dim=-2)
    v2 = torch.cat([v, v.new_zeros(b, h, 1, v.shape[-1])], dim=-2)       # (B, H, Nk + 1, d_v)
    if causal:  # the sink key sits after the real ones, so causality becomes a mask
        tril = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        mask = tril if mask is None else mask & tril
    if mask is not None:  # every query attends the sink
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    dtype = v.dtype
    return F.scaled_dot_product_attention(q2.to(dtype), k2.to(dtype), v2, attn_mask=mask,
                                          scale=1.0)
