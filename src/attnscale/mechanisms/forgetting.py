"""``forgetting``: Forgetting Attention, the attention of the Forgetting Transformer (FoX; Lin et
al. 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate", arXiv 2503.02130):

    f_t = σ(w_fᵀ x_t + b_f)                                  one forget gate per head and token
    z_ij = q_iᵀk_j / √d + Σ_{j<l≤i} log f_l = s_ij + c_i − c_j,   c_i = Σ_{l≤i} log f_l,   j ≤ i

with x_t the layer input (after its pre-norm).  The bias is a data-dependent decay: each token
between key j and query i multiplies the weight of j by its own forget gate, so FoX needs no
positional encoding (the paper's FoX has none; :attr:`Forgetting.encodes_position` tells the LM
to leave out RoPE).  W_f (d_model -> H) has a bias, with torch's standard ``nn.Linear`` init, as
the paper's base FoX (its "Pro" block adds output gates and norms, which are other mechanisms).

FoX is causal attention: a forget gate acts on the keys before a query, so the pipeline requires
``causal=True`` when forget gates are given.  Positions are top-left aligned, as SDPA's
``is_causal``: query i and key j sit at positions i and j of the one token stream whose gates
``log_forget`` (B, H, max(Nq, Nk)) holds.

Under the softmax, c_i is the same for every key of row i and cancels, so only −c_j per key
remains: the fused path folds it into SDPA as one extra q/k channel (:mod:`attnscale.kernels.
forgetting`), re-centred so that float32 keeps its precision, and switches to an exact blockwise
kernel when the range of c is too wide for that; on CUDA it is a FlexAttention ``score_mod``.
The statistics (the monitor, the guard) cover the logits the softmax sees, the bias included.

The gate needs the layer input, so FoX runs inside :class:`attnscale.attention.MultiHeadAttention`
and the LM (which build W_f through :meth:`Forgetting.init_projections`); as a bare module, or in
Hugging Face models, whose attention function sees only q, k and v, there are no forget gates
(f = 1: ``scaled``), and ``attnscale.hf.set_mechanism`` refuses it.  Its bias is not a scale of
q kᵀ, so QK-Clip is refused for it.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from attnscale.errors import ConfigError
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register
from attnscale.precision import upcast


@register("forgetting")
class Forgetting(Mechanism):
    """z_ij = q_iᵀk_j / √d + Σ_{j<l≤i} log f_l, f_t = σ(w_fᵀ x_t + b_f) per head, causal.
    Source: Lin et al. 2025 (FoX), arXiv 2503.02130."""

    # The logits carry the forget gates' decay: a bias of its own, read from the layer input.
    logit_bias = "forget"
    bilinear = False
    # The decay orders the keys: FoX is used without positional encoding.
    encodes_position = True
    # W_f lives beside the layer's projections.
    defined_at_init = False

    def __init__(self, d_head: int, n_heads: int):
        super().__init__(d_head, n_heads)
        self.w_f: nn.Linear | None = None

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    def init_projections(self, w_q: nn.Linear, w_k: nn.Linear) -> None:
        self.w_f = nn.Linear(w_q.in_features, self.n_heads, bias=True, device=w_q.weight.device,
                             dtype=w_q.weight.dtype)

    def forget_gates(self, x: Tensor) -> Tensor:
        """log f_t = log σ(w_fᵀ x_t + b_f): x (B, N, d_model) -> (B, H, N), float32 for half x
        (logsigmoid, exact where σ underflows)."""
        if self.w_f is None:
            raise ConfigError("forgetting: the forget gate needs the layer's input; build the "
                              "mechanism inside attnscale.MultiHeadAttention or the LM.")
        return F.logsigmoid(upcast(self.w_f(x))).transpose(-1, -2)   # (B, H, N)

    def no_weight_decay(self) -> set[str]:
        return set() if self.w_f is None else {"w_f.bias"}
