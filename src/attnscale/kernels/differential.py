"""Differential attention's two softmax maps on one SDPA call (Ye et al. 2024, arXiv 2410.05258):
(softmax(scale · q1 k1ᵀ) − λ softmax(scale · q2 k2ᵀ)) v, without the (B, H, Nq, Nk) logits.

The two maps of H heads are 2H heads of one call: q = [q1 | q2] and k = [k1 | k2] are split
along the head dimension and stacked along the heads, v is shared (repeated), and the output's
two halves are combined as o1 − λ o2.  The CPU flash kernel needs one head size for q, k and v,
so the halves of q and k (d/2) are padded with zeros to v's size (which doubles their share of
the matmuls; without it SDPA falls back to its materialising math backend).  fp16 and bf16 run
SDPA in their own type, which accumulates in float32, and combine the maps in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnscale.kernels.biased import nan_query_rows
from attnscale.precision import upcast


def split_maps(x: Tensor) -> tuple[Tensor, Tensor]:
    """[x1 | x2] (..., d) -> x1, x2 (..., d/2): the two maps' halves of q or k."""
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def differential_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, lam: Tensor,
                           mask: Tensor | None, causal: bool) -> Tensor:
    """(softmax(scale q1 k1ᵀ) − λ softmax(scale q2 k2ᵀ)) v masked: (B, H, Nq, d_v) in v's dtype.

    q, k (B, H, N·, d) float32 or float64 (d even: [first map | second map]); ``lam`` a 0-d
    tensor (or broadcastable to (B, H, 1, 1)); ``mask`` bool broadcastable to (B, H, Nq, Nk)
    leaving every query a key; ``causal`` top-left.
    """
    h = q.shape[1]
    q1, q2 = split_maps(q)
    k1, k2 = split_maps(k)
    qs = torch.cat([q1, q2], dim=1)                                        # (B, 2H, Nq, d/2)
    ks = torch.cat([k1, k2], dim=1)                                        # (B, 2H, Nk, d/2)
    vs = torch.cat([v, v], dim=1)                                          # (B, 2H, Nk, d_v)
    d_v = v.shape[-1]
    if q.device.type == "cpu" and qs.shape[-1] != d_v:  # zeros change no dot product
        width = max(qs.shape[-1], d_v)
        qs, ks = F.pad(qs, (0, width - qs.shape[-1])), F.pad(ks, (0, width - ks.shape[-1]))
        vs = F.pad(vs, (0, width - d_v))
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if mask.shape[1] > 1:  # one per head: the same for both maps of a head
            mask = torch.cat([mask, mask], dim=1)
    o = F.scaled_dot_product_attention(qs.to(v.dtype), ks.to(v.dtype), vs, attn_mask=mask,
                                       is_causal=causal, scale=scale)
    o = upcast(o[..., :d_v])
    return nan_query_rows(o[:, :h] - lam.to(o.dtype) * o[:, h:], q).to(v.dtype)
