"""``yarn``: the YaRN attention temperature for context extension (Peng et al. 2023).

YaRN multiplies both q and k by m = 0.1 · ln(factor) + 1 (its "sqrt(1/t)"), so the logits are
m² · qᵀk / √d; ``factor`` is the context-extension ratio (new length / trained length) and m = 1
for factor <= 1, where nothing is extended.
"""

from __future__ import annotations

import math

from torch import Tensor

from attnscale.errors import check_float
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Default context-extension ratio: 1 means no extension, where YaRN reduces to ``scaled``.
DEFAULT_FACTOR = 1.0
# m = YARN_SLOPE · ln(factor) + 1 (Peng et al. 2023, eq. 22).
YARN_SLOPE = 0.1


def yarn_m(factor: float) -> float:
    """YaRN's per-vector multiplier m = 0.1 · ln(factor) + 1, and 1 for factor <= 1."""
    return YARN_SLOPE * math.log(factor) + 1.0 if factor > 1.0 else 1.0


@register("yarn")
class YaRN(Mechanism):
    """z = m² qᵀk / √d, m = 0.1 ln(factor) + 1.  Source: Peng et al. 2023, "YaRN"."""

    def __init__(self, d_head: int, n_heads: int, *, factor: float = DEFAULT_FACTOR):
        super().__init__(d_head, n_heads)
        self.factor = check_float("factor", factor, positive=True)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, yarn_m(self.factor) ** 2 * inv_sqrt(self.d_head)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, factor={self.factor:g}"
