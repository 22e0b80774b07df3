"""``sink``: attention sinks, a per-head logit b_h in every row's softmax denominator whose key
carries no value, so a head can attend "nothing":

    p_i = e^{z_i} / (e^{b_h} + Σ_j e^{z_j}),   z = qᵀk / √d.

Sources (facts cited, no code copied):

* gpt-oss (OpenAI 2025), in HF transformers ``models/gpt_oss/modeling_gpt_oss.py``: one learned
  ``sinks`` parameter per attention head, concatenated as an extra column to the scaled, masked
  logits, softmaxed together, and the column dropped before the product with v;
* Megatron-LM's ``softmax_type``: ``"off-by-one"`` (b = 0, fixed) and ``"learnable"`` (b_h learned);
  softmax-off-by-one is Miller 2023, "Attention Is Off By One" (softmax1: 1 + Σ e^{z_j}).

``learned=True`` (default): b_h starts at 0 and is trained, without weight decay (it is a logit,
not a weight to shrink).  ``learned=False`` keeps b_h = 0 as a buffer: softmax1.
A query with every key masked puts all its mass on the sink: zero weights and zero output (not NaN,
and the same as the pipeline gives any row without keys).  The fast path is one extra key on SDPA
(:mod:`attnscale.kernels.sink`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnscale.errors import ConfigError
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Initial sink logit: 0, so e^b = 1 (softmax1 at init; Megatron's learnable sinks start there).
SINK_INIT = 0.0


@register("sink")
class Sink(Mechanism):
    """p_i = e^{z_i} / (e^{b_h} + Σ_j e^{z_j}), z = qᵀk / √d, b_h init 0 (learned by default).
    Source: gpt-oss (HF modeling_gpt_oss.py); Miller 2023 softmax1 for learned=False."""

    normaliser = "sink"

    def __init__(self, d_head: int, n_heads: int, *, learned: bool = True):
        super().__init__(d_head, n_heads)
        if not isinstance(learned, bool):
            raise ConfigError(f"learned must be true or false, got {learned!r}.")
        self.learned = learned
        init = torch.full((n_heads,), SINK_INIT)
        if learned:
            self.b = nn.Parameter(init)                 # (H,)
        else:
            self.register_buffer("b", init)             # softmax1: fixed at 0

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    def sink_logits(self) -> Tensor:
        return self.b

    def no_weight_decay(self) -> set[str]:
        return {"b"} if self.learned else set()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, learned={self.learned}"
