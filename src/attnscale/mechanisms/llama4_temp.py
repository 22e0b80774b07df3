"""``llama4-temp``: Llama 4's attention temperature tuning, z = τ(n) · qᵀk / √d.

τ(n) = attn_scale · ln(1 + ⌊n / floor_scale⌋) + 1, with floor_scale = 8192 and attn_scale = 0.1:
the temperature stays 1 for the first 8191 positions and then grows like a step-wise 0.1 · ln n,
a coarse version of SSMax's s · ln n (Nakanishi 2025, which Llama 4's modeling code cites).

Facts cited from Hugging Face transformers, ``models/llama4/modeling_llama4.py``
(``Llama4TextAttention.forward``) and ``configuration_llama4.py``:

* the query of absolute position ``pos`` (0-based: the cache length plus its index in the chunk) is
  multiplied by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``, computed in float32;
* the attention then runs with its usual ``scaling = head_dim ** -0.5``, so the two multiply:
  z = τ · qᵀk / √d;
* defaults ``floor_scale = 8192``, ``attn_scale = 0.1``, ``attn_temperature_tuning = True``;
* it applies only to the NoPE layers (``no_rope_layers``: by default every 4th layer carries no
  RoPE), never to the RoPE layers.  attnscale applies it on every layer that uses this mechanism,
  and it does not touch position encodings: use it on NoPE layers to reproduce Llama 4.

**Which position.**  ``prepare`` sees the number of keys each query attends, ``n_keys``, not a
position, and attnscale reads ``pos + 1`` as that count, n.  Under causality (top-left aligned,
as in attnscale's ``causal=True``) query i attends keys 0..i, so n = i + 1 = ``pos + 1`` and the
mechanism equals Llama 4 exactly for a sequence that starts at position 0.  The count is chosen over
the query's index because it is what the temperature is for: SSMax's argument is about the
number of keys the softmax spreads over, and that is defined for every attention pattern, while an
index is not.  Under full (bidirectional) attention every query attends all Nk keys and gets τ(Nk);
under a mask, n is the query's unmasked key count, so left padding does not count as positions
(Llama 4 counts absolute positions, padding included).  With a KV cache, as in
:mod:`attnscale.hf`, a decoding query attends every cached key and a cached chunk comes with its
causal mask, so n is pos + 1 there as well.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnscale.errors import ConfigError, check_float
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Llama 4's defaults (HF transformers, configuration_llama4.py: Llama4TextConfig).
LLAMA4_FLOOR_SCALE = 8192.0
LLAMA4_ATTN_SCALE = 0.1


def llama4_tau(n: Tensor | int, floor_scale: float = LLAMA4_FLOOR_SCALE,
               attn_scale: float = LLAMA4_ATTN_SCALE) -> Tensor | float:
    """τ(n) = attn_scale · ln(1 + ⌊n / floor_scale⌋) + 1 for n = pos + 1 keys; float64 tensors."""
    if isinstance(n, Tensor):
        return torch.log1p(torch.floor(n.to(torch.float64) / floor_scale)) * attn_scale + 1.0
    return math.log1p(math.floor(n / floor_scale)) * attn_scale + 1.0


@register("llama4-temp")
class Llama4Temp(Mechanism):
    """z = τ(n) qᵀk / √d, τ(n) = 0.1 ln(1 + ⌊n / 8192⌋) + 1 for the n keys a query attends.
    Source: Llama 4 attention temperature tuning (HF transformers modeling_llama4.py)."""

    def __init__(self, d_head: int, n_heads: int, *, floor_scale: float = LLAMA4_FLOOR_SCALE,
                 attn_scale: float = LLAMA4_ATTN_SCALE):
        super().__init__(d_head, n_heads)
        self.floor_scale = check_float("floor_scale", floor_scale, positive=True)
        self.attn_scale = check_float("attn_scale", attn_scale)
        if self.attn_scale < 0:  # a negative slope would turn the temperature negative at large n
            raise ConfigError(f"attn_scale must be >= 0, got {attn_scale!r}.")

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        tau = llama4_tau(n_keys, self.floor_scale, self.attn_scale)
        if isinstance(tau, Tensor):  # per query row, (..., Nq, 1)
            return q, k, (tau * inv_sqrt(self.d_head)).to(q.dtype)
        return q, k, tau * inv_sqrt(self.d_head)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, floor_scale={self.floor_scale:g}, "
                f"attn_scale={self.attn_scale:g}")
