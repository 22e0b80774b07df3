"""``softcap``: z = c · tanh(s / c) with s = qᵀk / √d, the logit soft-cap of Gemma 2 and Grok-1.

The cap bounds |z| < c after scaling and before masking, so no logit can run away however the
weights drift.  Gemma 2 uses c = 50 for attention logits; Grok-1's released model.py uses 30.  It is
the one mechanism that is not a scale on q and k, so it runs on
:func:`attnscale.kernels.softcap.capped_attention` instead of fused SDPA: a blockwise kernel on
the CPU, FlexAttention on CUDA.  c · tanh(s / c) is formed from one expm1, accurate for any c
(it tends to s as c grows).
"""

from __future__ import annotations

from torch import Tensor

from attnscale.errors import check_float
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Gemma 2's attn_logit_softcapping.
GEMMA2_CAP = 50.0
# Grok-1's attention logit cap (xai-org/grok-1 model.py, max_attn_val).
GROK1_CAP = 30.0


@register("softcap")
class SoftCap(Mechanism):
    """z = c tanh(qᵀk / (√d c)), c = 50.  Source: Gemma 2 (c = 50), Grok-1 (c = 30)."""

    def __init__(self, d_head: int, n_heads: int, *, cap: float = GEMMA2_CAP):
        super().__init__(d_head, n_heads)
        self.cap = check_float("cap", cap, positive=True)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cap={self.cap:g}"
