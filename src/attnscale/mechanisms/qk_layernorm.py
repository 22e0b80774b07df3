"""``qk-layernorm``: z = LayerNorm(q)ᵀ LayerNorm(k) / √d.

ViT-22B (Dehghani et al. 2023) and Chameleon (2024) normalise each head's q and k (``over="head"``,
the default); OLMo 2 (2024) normalises the whole q and k projections before the head split
(``over="model"``), i.e. over the (H, d) slice of each token jointly.  Gain 1, bias 0 at init.
``divisor=False`` drops the 1/√d (z = LN(q)ᵀ LN(k)): the essay's claim that with QK normalisation
the divisor no longer matters.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from attnscale.errors import ConfigError, check_choice
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

OVER_CHOICES = ("head", "model")
# torch.nn.LayerNorm's default epsilon.
LN_EPS = 1e-5


@register("qk-layernorm")
class QKLayerNorm(Mechanism):
    """z = LN(q)ᵀ LN(k) / √d, LN per head or over d_model.  Source: ViT-22B, Chameleon, OLMo 2."""

    bilinear = False       # prepare normalises q and k
    normalises_qk = True   # so scaling q and k leaves the logits alone

    rotation_invariant = False  # LayerNorm subtracts the mean over coordinates

    def __init__(self, d_head: int, n_heads: int, *, over: str = "head", divisor: bool = True):
        super().__init__(d_head, n_heads)
        self.over = check_choice("over", over, OVER_CHOICES)
        if not isinstance(divisor, bool):
            raise ConfigError(f"divisor must be true or false, got {divisor!r}.")
        self.divisor = divisor
        shape = (d_head,) if over == "head" else (n_heads, d_head)
        self.q_norm = nn.LayerNorm(shape, eps=LN_EPS)
        self.k_norm = nn.LayerNorm(shape, eps=LN_EPS)

    def _norm(self, norm: nn.LayerNorm, x: Tensor) -> Tensor:
        # x arrives upcast (float32 for a half module): the gain and bias follow it, so the
        # normalisation accumulates in float32 (LayerNorm on the CPU refuses mixed dtypes).
        def layer_norm(y: Tensor) -> Tensor:
            return F.layer_norm(y, norm.normalized_shape, norm.weight.to(y.dtype),
                                norm.bias.to(y.dtype), norm.eps)

        if self.over == "head":
            return layer_norm(x)  # over d, (B, H, N, d)
        # Over the whole projection: bring the heads next to d so (H, d) is one token's d_model.
        return layer_norm(x.transpose(1, 2)).transpose(1, 2)  # (B, N, H, d) -> (B, H, N, d)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        scale = inv_sqrt(self.d_head) if self.divisor else 1.0
        return self._norm(self.q_norm, q), self._norm(self.k_norm, k), scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, over={self.over!r}, divisor={self.divisor}"
