"""``learned-temp``: z = exp(β_h) · qᵀk, a learned per-head temperature (the essay, "Learn the
temperature").  β_h starts at -½ ln d, so exp(β_h) = 1/sqrt(d) and the module equals ``scaled`` at
init; learning β in log space keeps the temperature positive.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnscale.mechanisms.base import Mechanism, Scale, register


def beta_init(d_head: int) -> float:
    """β_0 = -½ ln d, so that exp(β_0) = 1/√d."""
    return -0.5 * math.log(d_head)


@register("learned-temp")
class LearnedTemp(Mechanism):
    """z = exp(β_h) qᵀk, β_h init −½ ln d.  Source: the essay, "Learn the temperature"."""

    def __init__(self, d_head: int, n_heads: int):
        super().__init__(d_head, n_heads)
        self.beta = nn.Parameter(torch.full((n_heads, 1, 1), beta_init(d_head)))  # (H, 1, 1)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, self.beta.exp()
