"""``scaled``: z = q·k / sqrt(d), the transformer default (Vaswani et al. 2017, footnote 4).

With q and k of independent unit-variance coordinates, q·k has variance d, so the divisor restores
unit-variance logits at initialisation.
"""

from __future__ import annotations

from torch import Tensor

from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register


@register("scaled")
class Scaled(Mechanism):
    """z = qᵀk / √d.  Source: Vaswani et al. 2017, "Attention Is All You Need"."""

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)
