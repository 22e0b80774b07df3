"""Forgetting Attention (FoX; Lin et al. 2025, arXiv 2503.02130) on the fused kernels:
softmax(scale · q kᵀ + c_i − c_j, causal) v without the (B, H, Nq, Nk) logits.

c is the cumulative sum of the log forget gates, so it falls steadily along the sequence: −700 at
1024 tokens with gates at σ(0) = 1/2.  SDPA takes no per-(row, key) bias short of a float mask as
large as the logits, but c_i − c_j is a sum of a query term and a key term, so it folds into q
and k as extra channels (a scale of 1 on the augmented vectors)::

    q'_i = [hi_i, 1, lo_i, 1, scale · q_i]
    k'_j = [1, −hi_j, 1, −lo_j, k_j]
    v'_j = [0, 0, 0, 0, v_j]

with c = hi + lo split into float32 halves.  Folded naively (one channel −c_j), a logit of a
query deep in the sequence would be a small score added to a large −c_j and lose float32's
precision: measured 3.5e-5 output error at 1024 tokens and 8e-4 at 16384, against SDPA's own
5e-7.  With the channels first, the dot product's running sum is hi_i − hi_j, exact for the keys
that carry weight (within a factor 2 of each other, Sterbenz), then the low parts and the score:
the logits keep SDPA's precision at any length (measured 9e-7 at 1024 and 1.3e-6 at 16384
tokens, float32 on the CPU, whose GEMMs add a dot product's terms in order).  The gradient
reaches c through the channels (Σ_i dZ_ij on the key side; the query side's row sums, zero for a
softmax, are kept).  The CPU flash kernel needs one head size for q, k and v, hence v's zero
channels; fp16 and bf16 run in float32 (a bf16 channel would round c by whole units).

The fold serves the CPU with a mask, where SDPA's fused kernel takes the mask.  Without one, the
CPU runs the blockwise kernel of :mod:`attnscale.kernels.biased` (the same float32 halves, added
per logit block: hi_i − hi_j first): it skips the keys above each block's diagonal, and the fold
pays for 68 channels instead of 64 and for writing q', k', v' twice.  Measured at B4 H8 N1024
d64, causal, forward + backward with the gates, interleaved at load 2.7-3.1: 1.06x SDPA's time
against the fold's 1.22x on 1 thread, 1.25x against 1.34x on 2; peak extra memory 54 MiB (the
fold on the whole input: 81; SDPA: 43).  With a 10% random mask the fold is the faster by 6%.

The channels' precision rests on the CPU GEMM adding a dot product's terms in order; a GPU's
need not, so on CUDA :func:`attnscale.kernels.flex.forget_attention` adds the same bias inside
FlexAttention with a ``score_mod`` (exact per logit, no channels), and without FlexAttention the
blockwise kernel does; under tracing (``torch.jit.trace``, ``torch.compile``, ``torch.export``)
the formula runs materialised.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnscale.kernels import flex
from attnscale.kernels.biased import ForgetBias, biased_attention, nan_query_rows
from attnscale.precision import all_finite, upcast



def forget_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: ForgetBias,
                     mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(scale · q kᵀ + c_i − c_j, masked) v: (B, H, Nq, d_v) in v's dtype.

    q, k (B, H, N·, d) float32 or float64; ``bias.c`` (B, H, N) with N >= Nq, Nk (float64 for
    float32 work, so that its low half is exact); ``mask`` bool broadcastable to (B, H, Nq, Nk)
    leaving every query a key; ``causal`` top-left.
    """
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _materialised(q, k, v, scale, bias, mask, causal)
    if flex.usable(q):
        return flex.forget_attention(q, k, v, scale, bias.c, mask, causal)
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or type(q) is not torch.Tensor:
        return _materialised(q, k, v, scale, bias, mask, causal)
    if q.device.type != "cpu" or mask is None:  # the blockwise kernel: see the module doc
        return biased_attention(q, k, v, scale, bias, mask, causal)
    return _folded(q, k, v, scale, bias.c, mask, causal)


def _materialised(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: ForgetBias,
                  mask: Tensor | None, causal: bool) -> Tensor:
    """The same attention with the (B, H, Nq, Nk) logits written out, on plain torch ops."""
    z = (q * scale) @ k.transpose(-2, -1) + bias.dense(q.shape[-2], k.shape[-2]).to(q.dtype)
    if causal:
        tri = torch.ones(z.shape[-2:], dtype=torch.bool, device=z.device).tril()
        mask = tri if mask is None else mask & tri
    if mask is not None:
        z = z.masked_fill(~mask, -math.inf)
    return (torch.softmax(z, dim=-1) @ upcast(v).to(q.dtype)).to(v.dtype)


def _folded(q: Tensor, k: Tensor, v: Tensor, scale: float, c: Tensor, mask: Tensor | None,
            causal: bool) -> Tensor:
    """SDPA on the augmented q', k', v' of the module doc."""
    work = q.dtype
    n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    q_parts, k_parts = [], []
    for part in _split(c, work):
        q_parts += [part[..., :n_q], torch.ones_like(part[..., :n_q])]
        k_parts += [torch.ones_like(part[..., :n_k]), -part[..., :n_k]]
    front = len(q_parts)
    q2 = torch.cat([torch.stack(q_parts, -1), q * scale], dim=-1)          # (B, H, Nq, 4 + d)
    k2 = torch.cat([torch.stack(k_parts, -1), k], dim=-1)                  # (B, H, Nk, 4 + d)
    v2 = upcast(v).to(work)
    width = max(q2.shape[-1], front + d_v)
    # The CPU flash kernel needs one head size: pad q', k' at the end, v' in front (its output
    # channels [front:] are then the output).
    q2 = F.pad(q2, (0, width - q2.shape[-1]))
    k2 = F.pad(k2, (0, width - k2.shape[-1]))
    v2 = F.pad(v2, (front, width - front - d_v))
    out = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, is_causal=causal, scale=1.0)
    return _nan_rows(out[..., front:front + d_v], q, c).to(v.dtype)


def _nan_rows(out: Tensor, q: Tensor, c: Tensor) -> Tensor:
    """NaN on the rows whose query or c_i is not finite (:func:`nan_query_rows`): c_i enters
    every logit of row i."""
    out = nan_query_rows(out, q)
    if all_finite(c):
        return out
    return out.masked_fill(~torch.isfinite(c[..., :q.shape[-2], None]), math.nan)


def _split(c: Tensor, work: torch.dtype) -> tuple[Tensor, Tensor]:
    """(hi, lo) with c = hi + lo in ``work``: hi a constant, lo carrying c's gradient; hi = 0
    when c already is in the working precision."""
    if c.dtype == work:
        return torch.zeros_like(c), c
    hi = c.detach().to(work)
    return hi, (c - hi.to(c.dtype)).to(work)
