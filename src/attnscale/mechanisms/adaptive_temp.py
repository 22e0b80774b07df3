"""``adaptive-temp``: the entropy-adaptive temperature of Veličković et al. 2024, "softmax is not
enough (for sharp out-of-distribution)", arXiv 2410.01104.

Each row's entropy H (nats) of softmax(s), s = qᵀk / √d over the keys the query attends, sets an
inverse temperature β(H), and the row becomes softmax(β · s):

    β(H) = max(1, -0.037 H⁴ + 0.481 H³ - 2.3 H² + 4.917 H - 1.791)   if H > 0.5,   else 1.

The polynomial is the paper's fit (its Figure 4 JAX listing, ``poly_fit = [-0.037, 0.481, -2.3,
4.917, -1.791]`` passed to ``jnp.polyval``, which takes the highest power first: -0.037 is the
coefficient of H⁴, -1.791 the constant).  Rows at H <= 0.5 are left alone ("don't overcorrect
low-entropy heads") and β is never below 1 ("never increase entropy").  The listing computes the
entropy with ``log(p + 1e-9)``; here it is the exact entropy of the row kernel, which differs by
less than n · 1e-9 nats.

Gradients flow through β(H), as in the paper: its listing applies no stop-gradient, so autodiff
differentiates β's polynomial and the entropy (attnscale's entropy pass has its own backward,
:mod:`attnscale.kernels.entropy`).  β is a per-row factor on the scale, so after that one
statistics pass the attention itself runs on SDPA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnscale.kernels.entropy import row_entropy
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# β(H)'s polynomial, highest power first (jnp.polyval order), from the paper's listing.
POLY_FIT = (-0.037, 0.481, -2.3, 4.917, -1.791)
# Below or at this entropy (nats) β = 1.
ENTROPY_THRESHOLD = 0.5


def beta(entropy: Tensor) -> Tensor:
    """β(H) = max(1, polyval(POLY_FIT, H)) where H > 0.5, else 1; differentiable."""
    poly = torch.zeros_like(entropy)
    for c in POLY_FIT:  # Horner, highest power first
        poly = poly * entropy + c
    one = torch.ones_like(entropy)
    return torch.where(entropy > ENTROPY_THRESHOLD, torch.maximum(poly, one), one)


@register("adaptive-temp")
class AdaptiveTemp(Mechanism):
    """z = β(H) qᵀk / √d, H the entropy of softmax(qᵀk / √d), β(H) = max(1, -0.037 H⁴ + 0.481 H³
    - 2.3 H² + 4.917 H - 1.791) for H > 0.5, else 1.  Source: Veličković et al. 2024,
    arXiv 2410.01104 (Figure 4)."""

    bilinear = False  # β depends on q and k
    per_key = False   # ... through the entropy of the whole row

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    def row_temperature(self, q: Tensor, k: Tensor, scale: Scale, mask: Tensor | None,
                        causal: bool) -> Tensor:
        return beta(row_entropy(q, k, mask, causal, scale))   # (B, H, Nq, 1)
