"""``differential``: differential attention, the difference of two softmax maps (Ye et al. 2024,
"Differential Transformer", arXiv 2410.05258, Section 2.1):

    [q1; q2] = q,  [k1; k2] = k            each head's q and k split into halves of d' = d / 2
    DiffAttn = (softmax(q1 k1ᵀ / √d') − λ softmax(q2 k2ᵀ / √d')) v          v keeps all d
    λ = exp(λ_q1 · λ_k1) − exp(λ_q2 · λ_k2) + λ_init                         (the paper's eq. 2)
    λ_init = 0.8 − 0.6 · exp(−0.3 (l − 1)),  l ∈ [1, L] the layer's depth
    o = (1 − λ_init) · RMSNorm(DiffAttn)                                    per head, before W_O

The re-parameterisation keeps λ's learning dynamics in step with the other weights: λ_q1, λ_k1,
λ_q2, λ_k2 ∈ R^{d'} start at N(0, 0.1²) (the paper's code; transformers' DiffLlama
``lambda_std_dev``), one set per layer shared by its heads, drawn with the layer's projections
(:meth:`Differential.init_projections`, from torch's generator as ``nn.Linear`` draws W_Q); a
bare mechanism, built without projections, keeps them at 0, so that λ = λ_init exactly.  The
per-head normalisation ("GroupNorm" in the paper: an RMSNorm over each head's outputs, eps 1e-5)
and the fixed factor (1 − λ_init) keep the gradient flow close to a Transformer's.  The norm
has no gain, as in transformers' DiffLlama (``elementwise_affine=False``); the paper's code has
one shared by the heads, which W_O absorbs.  A model that stacks layers tells each layer's mechanism its depth
(:meth:`Differential.at_depth`, the LM does); option ``layer`` sets it for one layer, option
``lambda_init`` fixes λ_init whatever the depth.

The weights are w = p1 − λ p2, which can be negative and sum to 1 − λ per row, so the
statistics are defined for them (:mod:`attnscale.stats`, normaliser ``"differential"``): the
logits of a row are the two maps side by side, [z1 | z2], (..., 2n).  On the fused path the two
maps are one SDPA call with 2H heads (:mod:`attnscale.kernels.differential`).  Its logits are not
one scale · q kᵀ of the projected q and k, so QK-Clip (the guard's ``qk_clip``) is refused for
it; Hugging Face models have no λ vectors, so ``attnscale.hf.set_mechanism`` refuses it
(transformers' DiffLlama family is differential attention itself).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnscale.errors import ConfigError, check_float, check_int
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register
from attnscale.mechanisms.rownorm import rms_rows

# λ_q1, λ_k1, λ_q2, λ_k2 ~ N(0, LAMBDA_STD²): the paper's code, transformers' DiffLlama default.
LAMBDA_STD = 0.1
# eps of the per-head RMSNorm of the output (the paper's code: RMSNorm(2 d', eps=1e-5)).
SUBLN_EPS = 1e-5


def lambda_init_at(layer: int) -> float:
    """λ_init = 0.8 − 0.6 exp(−0.3 (l − 1)) for the layer at depth l >= 1 (arXiv 2410.05258,
    Section 2.1): 0.2 in the first layer, rising towards 0.8 with depth."""
    return 0.8 - 0.6 * math.exp(-0.3 * (check_int("layer", layer, minimum=1) - 1))


@register("differential")
class Differential(Mechanism):
    """o = (1 − λ_init) RMSNorm((softmax(q1k1ᵀ/√d') − λ softmax(q2k2ᵀ/√d')) v), λ = exp(λq1·λk1)
    − exp(λq2·λk2) + λ_init, λ_init = 0.8 − 0.6 exp(−0.3 (l − 1)).
    Source: Ye et al. 2024, arXiv 2410.05258."""

    normaliser = "differential"
    # q and k are halved into two maps: the logits are not one scale · q kᵀ.
    bilinear = False
    # The output is normalised per head (normalise_output) before the gate and W_O.
    normalises_output = True
    # λ's vectors are weights of the layer, drawn with its projections.
    defined_at_init = False
    # q and k are split at a fixed coordinate: a rotation of q and k mixes the two maps.
    rotation_invariant = False

    def __init__(self, d_head: int, n_heads: int, *, layer: int = 1,
                 lambda_init: float | None = None):
        super().__init__(d_head, n_heads)
        if d_head % 2:
            raise ConfigError(f"differential attention splits each head's q and k in two halves: "
                              f"d_head must be even, got {d_head}.")
        self.layer = check_int("layer", layer, minimum=1)
        self.fixed_init = None if lambda_init is None else check_float("lambda_init", lambda_init)
        half = d_head // 2
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.zeros(half)) for _ in range(4))

    def init_projections(self, w_q: nn.Linear, w_k: nn.Linear) -> None:
        with torch.no_grad():  # the paper's init, drawn with the layer's weights
            for vector in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
                vector.normal_(0.0, LAMBDA_STD)

    @property
    def lambda_init(self) -> float:
        """λ_init: the option, else the paper's schedule at this layer's depth."""
        return lambda_init_at(self.layer) if self.fixed_init is None else self.fixed_init

    def at_depth(self, layer: int) -> None:
        self.layer = check_int("layer", layer, minimum=1)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        # q and k stay whole, [q1 | q2] and [k1 | k2]; the scale is the half's, 1/√d'.
        return q, k, inv_sqrt(self.d_head // 2)

    def lam(self) -> Tensor:
        """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, a 0-d tensor shared by the heads."""
        return (torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
                - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2)) + self.lambda_init)

    def normalise_output(self, o: Tensor) -> Tensor:
        """(1 − λ_init) · RMSNorm(o) over each head's outputs: o (B, H, Nq, d_v).  The factor is
        the norm's gain, so that no second (B, H, Nq, d_v) tensor is made either way (and float32
        on the CPU runs on the compiled RMSNorm kernels, one pass each way)."""
        gain = torch.full(o.shape[-1:], 1.0 - self.lambda_init, dtype=o.dtype, device=o.device)
        return rms_rows(o, gain, SUBLN_EPS)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layer={self.layer}, lambda_init={self.lambda_init:g}"
