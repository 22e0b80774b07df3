"""``cosine``: z = exp(τ_h) · cos(q, k), Swin Transformer V2's scaled cosine attention.

Liu et al. 2022 write cos(q, k) / τ with a learned per-head temperature; their code learns
τ_h = log(1/τ) initialised at ln 10, clamps it at ln 100 (so 1/τ <= 100), and keeps it out of weight
decay.  There is no sqrt(d) anywhere.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnscale.mechanisms.base import Mechanism, Scale, register
from attnscale.mechanisms.rownorm import unit_rows

# Swin V2: logit_scale = log(10) at init, clamped at log(1 / 0.01).
TAU_INIT = math.log(10.0)
TAU_MAX = math.log(100.0)


@register("cosine")
class Cosine(Mechanism):
    """z = exp(min(τ_h, ln 100)) cos(q, k), τ_h init ln 10.  Source: Liu et al. 2022, Swin V2."""

    bilinear = False       # prepare normalises q and k
    normalises_qk = True   # so scaling q and k leaves the logits alone

    def __init__(self, d_head: int, n_heads: int):
        super().__init__(d_head, n_heads)
        self.tau = nn.Parameter(torch.full((n_heads, 1, 1), TAU_INIT))  # per head, (H, 1, 1)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        scale = self.tau.clamp(max=TAU_MAX).exp()  # (H, 1, 1)
        return unit_rows(q, scale), unit_rows(k), 1.0  # the temperature folded into q's norm

    def no_weight_decay(self) -> set[str]:
        return {"tau"}  # Swin V2 excludes logit_scale from weight decay
