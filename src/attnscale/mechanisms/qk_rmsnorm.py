"""``qk-rmsnorm``: z = RMSNorm(q)ᵀ RMSNorm(k) / √d.

RMSNorm(x) = g ⊙ x / sqrt(mean(x²) + eps), gain 1 at init, one norm for q and one for k.  Current
models differ in what the mean runs over (option ``over``):

* ``over="head"`` (default): over each head's d coordinates, one gain vector of d shared by the
  heads: Gemma 3 (Gemma Team 2025) and Qwen3 (``q_norm``/``k_norm`` of ``head_dim`` in HF's
  ``modeling_qwen3.py``, ``modeling_gemma3.py``);
* ``over="model"``: over the whole q (or k) projection of a token, all heads' H·d coordinates
  together, before the head split, with one gain per coordinate (H·d): OLMo 2 (``q_norm`` of
  ``num_heads * head_dim`` applied before the reshape, HF ``modeling_olmo2.py``) and MiniMax-M2.

With one head the two are the same.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnscale.errors import check_choice
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register
from attnscale.mechanisms.qk_layernorm import OVER_CHOICES
from attnscale.mechanisms.rownorm import rms_heads, rms_rows

# Gemma 3's rms_norm_eps.
RMS_EPS = 1e-6


@register("qk-rmsnorm")
class QKRMSNorm(Mechanism):
    """z = RMSNorm(q)ᵀ RMSNorm(k) / √d, gain 1, eps 1e-6, per head or over the whole projection
    (``over``).  Source: Gemma 3 technical report (per head); OLMo 2 (over the model width)."""

    bilinear = False       # prepare normalises q and k
    normalises_qk = True   # so scaling q and k leaves the logits alone

    def __init__(self, d_head: int, n_heads: int, *, over: str = "head"):
        super().__init__(d_head, n_heads)
        self.over = check_choice("over", over, OVER_CHOICES)
        # RMSNorm weights for q and k: (d,) shared by the heads, or (H, 1, d) for every
        # coordinate of the projection (broadcast over (B, H, N, d)).
        shape = (d_head,) if over == "head" else (n_heads, 1, d_head)
        self.q_gain = nn.Parameter(torch.ones(shape))
        self.k_gain = nn.Parameter(torch.ones(shape))

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        norm = rms_rows if self.over == "head" else rms_heads
        return (norm(q, self.q_gain.to(q.dtype), RMS_EPS),
                norm(k, self.k_gain.to(k.dtype), RMS_EPS), inv_sqrt(self.d_head))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, over={self.over!r}"
