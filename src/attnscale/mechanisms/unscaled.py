"""``unscaled``: z = q·k, the essay's baseline with the 1/sqrt(d) deleted."""

from __future__ import annotations

from torch import Tensor

from attnscale.mechanisms.base import Mechanism, Scale, register


@register("unscaled")
class Unscaled(Mechanism):
    """z = qᵀk; logit std grows like √d and the softmax saturates.  Source: the essay's baseline."""

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, 1.0
