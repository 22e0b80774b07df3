"""``mup``: z = α · q·k / d, the muP attention scaling (Yang, Hu et al. 2022, Tensor Programs V).

Once training aligns q with k, q·k grows like d (law of large numbers), not sqrt(d); muP divides
by d so the logits stay O(1) as width grows.
"""

from __future__ import annotations

from torch import Tensor

from attnscale.errors import check_float
from attnscale.mechanisms.base import Mechanism, Scale, register

# The muP attention multiplier α in α · qᵀk / d (a tunable constant, 1 by default).
DEFAULT_ALPHA = 1.0


@register("mup")
class MuP(Mechanism):
    """z = α qᵀk / d.  Source: Yang, Hu et al. 2022, "Tensor Programs V" (muP)."""

    def __init__(self, d_head: int, n_heads: int, *, alpha: float = DEFAULT_ALPHA):
        super().__init__(d_head, n_heads)
        self.alpha = check_float("alpha", alpha, positive=True)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, self.alpha / self.d_head

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha:g}"
