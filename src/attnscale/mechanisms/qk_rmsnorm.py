"""``qk-rmsnorm``: z = RMSNorm(q)ᵀ RMSNorm(k) / √d per head, as in Gemma 3 (Gemma Team 2025).

RMSNorm(x) = g ⊙ x / sqrt(mean(x²) + eps) over the head dimension, one gain vector for q and one
for k (shared by the heads), gain 1 at init.
"""

from __future__ import annotations

from torch import Tensor, nn

from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Gemma 3's rms_norm_eps.
RMS_EPS = 1e-6


@register("qk-rmsnorm")
class QKRMSNorm(Mechanism):
    """z = RMSNorm(q)ᵀ RMSNorm(k) / √d, gain 1, eps 1e-6.  Source: Gemma 3 technical report."""

    def __init__(self, d_head: int, n_heads: int):
        super().__init__(d_head, n_heads)
        self.q_norm = nn.RMSNorm(d_head, eps=RMS_EPS)
        self.k_norm = nn.RMSNorm(d_head, eps=RMS_EPS)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return self.q_norm(q), self.k_norm(k), inv_sqrt(self.d_head)
