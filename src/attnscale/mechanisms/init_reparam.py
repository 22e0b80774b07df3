"""``init-reparam``: the 1/sqrt(d) moved into the initialisation of W_Q and W_K.

z = qᵀk with no divisor, but W_Q and W_K start at d^(-1/4) times their standard init, so
z = (d^(-1/4) W_Q x)ᵀ (d^(-1/4) W_K y) = (W_Q x)ᵀ (W_K y) / √d: identical to ``scaled`` at step 0
(the essay, "Move it into the initialization").  As a bare module (no projections) it is
``unscaled``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnscale.mechanisms.base import Mechanism, Scale, register

# W_Q and W_K init multiplier is d ** INIT_EXPONENT; two factors of d^(-1/4) make the 1/sqrt(d).
INIT_EXPONENT = -0.25


def init_gain(d_head: int) -> float:
    """d^(-1/4), the factor applied to the standard init of W_Q and W_K."""
    return d_head ** INIT_EXPONENT


@register("init-reparam")
class InitReparam(Mechanism):
    """z = qᵀk with W_Q, W_K initialised at d^(-1/4) × standard.  Source: the essay."""

    defined_at_init = False  # the temperature lives in the init of W_Q and W_K, not in q and k

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, 1.0

    def init_projections(self, w_q: nn.Linear, w_k: nn.Linear) -> None:
        # Scale the whole affine map (bias too): q and k are exactly d^(-1/4) of the standard ones.
        with torch.no_grad():
            for p in (*w_q.parameters(), *w_k.parameters()):
                p.mul_(init_gain(self.d_head))
