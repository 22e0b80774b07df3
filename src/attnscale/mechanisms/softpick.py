"""``softpick``: the rectified softmax (Zuhri et al. 2025, "Softpick: No Attention Sink, No
Massive Activations with Rectified Softmax", arXiv 2504.20966), on the scaled logits z = qᵀk / √d:

    p_i = ReLU(e^{z_i} - 1) / (Σ_j |e^{z_j} - 1| + ε),   ε = 1e-8,

over the keys a query attends.  A key with z_i <= 0 gets weight exactly 0 (yet still enters the
denominator, so its gradient does not vanish), and rows need not sum to 1: a head can attend
nothing without a sink token to park its weight on, which is the paper's claim (0% sink rate where
softmax models have sinks).  Computed stably, shifted by max(0, row max) in numerator and
denominator; on a blockwise kernel with recomputation in the backward, no (B, H, Nq, Nk) tensor
(:mod:`attnscale.kernels.softpick`).  A row with every key masked, or every logit <= 0, has zero
weights and zero output.
"""

from __future__ import annotations

from torch import Tensor

from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register


@register("softpick")
class Softpick(Mechanism):
    """p_i = ReLU(e^{z_i} - 1) / (Σ_j |e^{z_j} - 1| + ε), z = qᵀk / √d, ε = 1e-8.
    Source: Zuhri et al. 2025, arXiv 2504.20966."""

    normaliser = "softpick"

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)
