"""``sigmoid``: sigmoid attention, each weight its own sigmoid with no row normaliser:

    p_i = σ(qᵀk_i / √d + b),   b = -ln n by default,

with n the number of keys the row attends (Ramapuram et al. 2024, "Theory, Analysis, and Best
Practices for Sigmoid Self-Attention", arXiv 2409.04431, and ``apple/ml-sigmoid-attention``).
The bias b = -ln n keeps Σ_i p_i of order one at init (σ(z - ln n) ≈ e^z / n for z ≪ ln n), the
paper's remedy for the large initial attention norms that otherwise destabilise training.  Option
``bias``: a fixed b instead of -ln n.

Rows do not sum to 1, so :mod:`attnscale.stats` defines each statistic for them (total mass,
max weight, entropy of the normalised row, ``||diag(σ(1-σ))||_F``).  A row with every key masked
has all-zero weights and zero output.  The fast path is a blockwise kernel with recomputation in
the backward (:mod:`attnscale.kernels.sigmoid`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnscale.errors import check_float
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register


def log_n_bias(n_keys: int | Tensor) -> float | Tensor:
    """b = -ln n for n attended keys; rows without keys get 0 (their weights are all masked)."""
    if isinstance(n_keys, Tensor):
        return -torch.log(n_keys.clamp(min=1).to(torch.float64))
    return -math.log(max(n_keys, 1))


@register("sigmoid")
class Sigmoid(Mechanism):
    """p_i = σ(qᵀk_i / √d + b), b = -ln n (n keys attended) or the option ``bias``.
    Source: Ramapuram et al. 2024, arXiv 2409.04431 (apple/ml-sigmoid-attention)."""

    normaliser = "sigmoid"
    has_offset = True

    def __init__(self, d_head: int, n_heads: int, *, bias: float | None = None):
        super().__init__(d_head, n_heads)
        self.bias = None if bias is None else check_float("bias", bias)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    def offset(self, n_keys: int | Tensor) -> float | Tensor:
        return log_n_bias(n_keys) if self.bias is None else self.bias

    def extra_repr(self) -> str:
        bias = "-ln n" if self.bias is None else f"{self.bias:g}"
        return f"{super().extra_repr()}, bias={bias}"
