"""``qk-rmsnorm``: z = RMSNorm(q)ᵀ RMSNorm(k) / √d per head, as in Gemma 3 (Gemma Team 2025).

RMSNorm(x) = g ⊙ x / sqrt(mean(x²) + eps) over the head dimension, one gain vector for q and one
for k (shared by the heads), gain 1 at init.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register
from attnscale.mechanisms.rownorm import rms_rows

# Gemma 3's rms_norm_eps.
RMS_EPS = 1e-6


@register("qk-rmsnorm")
class QKRMSNorm(Mechanism):
    """z = RMSNorm(q)ᵀ RMSNorm(k) / √d, gain 1, eps 1e-6.  Source: Gemma 3 technical report."""

    bilinear = False       # prepare normalises q and k
    normalises_qk = True   # so scaling q and k leaves the logits alone

    def __init__(self, d_head: int, n_heads: int):
        super().__init__(d_head, n_heads)
        self.q_gain = nn.Parameter(torch.ones(d_head))  # RMSNorm weight for q, shared by heads
        self.k_gain = nn.Parameter(torch.ones(d_head))

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return (rms_rows(q, self.q_gain, RMS_EPS), rms_rows(k, self.k_gain, RMS_EPS),
                inv_sqrt(self.d_head))
