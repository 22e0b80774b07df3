"""``ssmax``: Scalable-Softmax, z = s_h · ln(n) · qᵀk / √d (Nakanishi 2025).

n is the number of keys the query attends (all keys, its causal prefix, or its unmasked keys), so
the temperature grows with context length and the attention does not flatten as n grows.  s_h is
learned per head; 0.43 is its initial value.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Initial s in s · ln(n) (Nakanishi 2025).
S_INIT = 0.43


@register("ssmax")
class SSMax(Mechanism):
    """z = s_h ln(n) qᵀk / √d, s_h init 0.43.  Source: Nakanishi 2025, "Scalable-Softmax"."""

    def __init__(self, d_head: int, n_heads: int):
        super().__init__(d_head, n_heads)
        self.s = nn.Parameter(torch.full((n_heads, 1, 1), S_INIT))  # per head, (H, 1, 1)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        # A row with no key to attend (n = 0) gets ln 1 = 0: its output is zero whatever the
        # temperature, and the logarithm stays finite.
        if isinstance(n_keys, Tensor):  # per query row, (..., Nq, 1)
            log_n = torch.log(n_keys.clamp(min=1).to(q.dtype))
        else:
            log_n = math.log(max(n_keys, 1))
        return q, k, self.s * log_n * inv_sqrt(self.d_head)
