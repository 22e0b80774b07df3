"""``gated``: gated attention, the attention output multiplied by a sigmoid gate of the layer input
before W_O (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv 2505.06708; the
gate of Qwen3-Next's full-attention layers):

    o_h = σ(x W_g)_h ∘ softmax(qᵀk / √d) v,    then  W_O [o_1, ..., o_H],

with x the input of the attention layer (after its pre-norm).  The paper's best placement is this
one, after SDPA and before the output projection, with a head-specific gate; ``granularity``:
``"head"`` (default) gives one gate per head, W_g (d_model -> H); ``"element"`` one per output
coordinate, W_g (d_model -> H · d_head), the paper's elementwise variant.  W_g has no bias and
torch's standard ``nn.Linear`` init; the gate starts near σ(0) = 1/2.

The gate acts on the output, not on the logits: the logits and weights are ``scaled``'s, and the
monitor reports them unchanged, with the gate's mean as a statistic of its own (``gate_mean``).
It needs the layer input, so it runs inside :class:`attnscale.attention.MultiHeadAttention` and
the LM, which build W_g through :meth:`init_projections` and pass the gate to the pipeline; as a
bare module (no layer input) it is ``scaled``, and Hugging Face models, whose attention function
sees only q, k and v, cannot take it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnscale.errors import ConfigError, check_choice
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# One gate per head (the default) or one per output coordinate.
GRANULARITIES = ("head", "element")


@register("gated")
class Gated(Mechanism):
    """o = σ(x W_g) ∘ softmax(qᵀk / √d) v, gate per head (or per element), before W_O.
    Source: Qiu et al. 2025, arXiv 2505.06708 (Qwen3-Next)."""

    gate = True
    # The gate lives in a weight of its own, W_g, built with the layer's projections.
    defined_at_init = False

    def __init__(self, d_head: int, n_heads: int, *, granularity: str = "head"):
        super().__init__(d_head, n_heads)
        self.granularity = check_choice("granularity", granularity, GRANULARITIES)
        self.w_g: nn.Linear | None = None

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    def init_projections(self, w_q: nn.Linear, w_k: nn.Linear) -> None:
        width = self.n_heads * (1 if self.granularity == "head" else self.d_head)
        self.w_g = nn.Linear(w_q.in_features, width, bias=False, device=w_q.weight.device,
                             dtype=w_q.weight.dtype)

    def gate_values(self, x: Tensor) -> Tensor:
        """σ(x W_g): x (B, N, d_model) -> (B, H, N, 1) per head or (B, H, N, d_head) per element."""
        if self.w_g is None:
            raise ConfigError("gated: the gate needs the layer's input; build the mechanism inside "
                              "attnscale.MultiHeadAttention or the LM.")
        g = torch.sigmoid(self.w_g(x))                              # (B, N, H·(1|d))
        # Only the last axis is split, so an empty sequence (N = 0) splits as any other.
        return g.unflatten(-1, (self.n_heads, -1)).transpose(1, 2)  # (B, H, N, 1|d)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, granularity={self.granularity}"
