"""``stick-breaking``: stick-breaking attention (Tan et al. 2024, "Scaling Stick-Breaking
Attention: An Efficient Implementation and In-depth Study", arXiv 2410.17980), on the scaled
logits z = qᵀk / √d.  Each key j a query attends takes the share β_j = σ(z_j) of what the keys
nearer to the query left of the stick:

    p_j = β_j Π_{j < k} (1 - β_k),   log p_j = log σ(z_j) - Σ_{j < k} softplus(z_k),

the product over the attended keys after j (under causality j <= k <= i for query i; without
causality every key, the query taken to come after them all).  Computed in log space, as the paper
does.  Rows sum to 1 - Π_k (1 - β_k) <= 1 (the stick left over goes to nothing), and the weights
favour the nearest keys by construction, so the mechanism carries the order of the keys itself:
the paper uses it without a positional encoding (``encodes_position``: attnscale's LM leaves out
RoPE for it).  The paper's claim: length generalisation (a model trained at 2^11 tokens works at 2^14).

Runs on a blockwise kernel with recomputation in the backward, no (B, H, Nq, Nk) tensor
(:mod:`attnscale.kernels.stick_breaking`).  A row with every key masked has zero output.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register


@register("stick-breaking")
class StickBreaking(Mechanism):
    """p_j = σ(z_j) Π_{k > j} (1 - σ(z_k)) over the attended keys in order, z = qᵀk / √d.
    Source: Tan et al. 2024, arXiv 2410.17980."""

    normaliser = "stick-breaking"
    # The weights depend on the order of the keys (recency), the only position they need: a
    # model built around the mechanism leaves out its positional encoding (the paper's setup).
    encodes_position: ClassVar[bool] = True

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)
