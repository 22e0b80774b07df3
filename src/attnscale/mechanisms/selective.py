"""``selective``: selective attention (Leviathan, Kalman and Matias 2024, "Selective Attention
Improves Transformer", arXiv 2410.02703): a token may decide that an earlier token is no longer
needed, and every later token then attends it less.

    z⁰ = q⁰ k⁰ᵀ / √d                        the first head's logits: the selection, no parameters
    S_kj = max(0, z⁰_kj)   for 1 ≤ j < k    only positive selection; the first token (BOS) and a
                                            token's own key are never selected; k must attend j
    F_ij = Σ_{j<k<i} S_kj                   accumulated over the tokens strictly between j and i
    z_ij = q_iᵀk_j / √d − F_ij               in every head (head 0 included)

so F only grows along a sequence ("mask strictly in the future": a token's selection acts on the
tokens after it, not on itself).  Positions are top-left aligned, as SDPA's ``is_causal``: query
k and key j sit at positions k and j, and S only reads pairs j < k, whatever ``causal`` is, so
without causality a key after the query keeps F = 0.  A query with every key masked selects
nothing.  Gradients flow through F into the first head's q and k, as in the paper's formulation
(no stop-gradient).

The paper's claim (its Table): with context pruning, the same validation loss as without
selective attention with 16×, 25× and 47× less attention memory at context 512, 1024 and 2048.

F is a prefix sum over queries of the first head's logits, not a function of one (query, key)
pair, so FlexAttention's ``score_mod`` does not apply: the fused path is a blockwise kernel that
carries the column sums of S from one block of queries to the next
(:mod:`attnscale.kernels.biased`), on the CPU and on CUDA alike, without the (B, H, Nq, Nk)
logits.  The statistics (the monitor, the guard) cover the logits the softmax sees, −F included.
Its bias is not a scale of q kᵀ, so QK-Clip is refused for it.

Option ``budget``: the paper's context pruning (its Section 4), each query attending at most
``budget`` keys, those it attends that were selected least (lowest F; ties go to the most recent
key), as a memory budget at inference; None (default) attends every key.  A key's F only grows
along the sequence, so a pruned key is, in the paper's setting, evicted for good; here each row
chooses anew, which can only keep more.
"""

from __future__ import annotations

from torch import Tensor

from attnscale.errors import check_int
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register


@register("selective")
class Selective(Mechanism):
    """z_ij = q_iᵀk_j / √d − Σ_{j<k<i} max(0, z⁰_kj), z⁰ the first head's logits, key 0 and a
    token's own key never selected.  Source: Leviathan et al. 2024, arXiv 2410.02703."""

    # −F: a bias that depends on the whole sequence of the first head's logits.
    logit_bias = "select"
    bilinear = False

    def __init__(self, d_head: int, n_heads: int, *, budget: int | None = None):
        super().__init__(d_head, n_heads)
        self.budget = None if budget is None else check_int("budget", budget, minimum=1)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.budget is None else f", budget={self.budget}")
