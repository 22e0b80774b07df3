"""``qknorm``: z = g · cos(q, k), QKNorm (Henry et al. 2020).

q and k are L2-normalised along the head dimension, so their dot product is a cosine in [-1, 1], and
one learned scalar g per layer replaces 1/sqrt(d) as the temperature.  The paper initialises
g = log2(L² - L), with L the longest sequence length in the training data.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnscale.errors import ConfigError, check_int
from attnscale.mechanisms.base import Mechanism, Scale, register
from attnscale.mechanisms.rownorm import unit_rows

# L in g_0 = log2(L² - L) when no ``max_len`` is given.
DEFAULT_MAX_LEN = 128


def qknorm_g_init(max_len: int) -> float:
    """Henry et al.'s initial temperature g_0 = log2(L² - L)."""
    return math.log2(max_len * max_len - max_len)


@register("qknorm")
class QKNorm(Mechanism):
    """z = g cos(q, k), g init log2(L² − L).  Source: Henry et al. 2020, "QKNorm"."""

    bilinear = False       # prepare normalises q and k
    normalises_qk = True   # so scaling q and k leaves the logits alone

    def __init__(self, d_head: int, n_heads: int, *, max_len: int = DEFAULT_MAX_LEN):
        super().__init__(d_head, n_heads)
        self.max_len = check_int("max_len", max_len, minimum=1)
        if self.max_len < 2:  # L² - L = 0 at L = 1, and log2(0) is -inf
            raise ConfigError(f"max_len must be >= 2, got {max_len}.")
        self.g = nn.Parameter(torch.tensor(qknorm_g_init(self.max_len)))  # one scalar per layer

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        # g folded into q's normalisation: one pass over q instead of two.
        return unit_rows(q, self.g), unit_rows(k), 1.0

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_len={self.max_len}"
