"""Softpick, the rectified softmax (Zuhri et al. 2025, "Softpick: No Attention Sink, No Massive
Activations with Rectified Softmax", arXiv 2504.20966):

    p_i = ReLU(e^{z_i} - 1) / (Σ_j |e^{z_j} - 1| + ε),   ε = 1e-8,

over the keys a row attends (a masked key is left out of the sum, not counted as |e^{-inf} - 1| =
1).  Rows need not sum to 1 and a weight is exactly 0 wherever z_i <= 0.

Stable form.  With M = max(0, max_j z_j) and c = e^{-M} (both numerator and denominator times
e^{-M}, as the paper shifts by the row max):

    u_i = e^{z_i - M} - c,   D = Σ_j |u_j| + ε c,   p_i = max(u_i, 0) / D,

so every exponential is <= 1, and c <= 1 too (shifting by a negative maximum would overflow e^{-M};
a row whose logits are all <= 0 has p = 0 either way).  This is the paper's equation exactly, M
cancelling; the authors' code adds ε after the shift (ε e^{M} in unshifted units), which differs
from it by a relative ~ε.

Gradient.  p_i = a_i / (S + ε) with a_i = ReLU(e^{z_i} - 1), S = Σ_j |e^{z_j} - 1|, so

    ∂p_i/∂z_j = δ_ij [z_i > 0] e^{z_i} / (S + ε) - p_i sgn(z_j) e^{z_j} / (S + ε),
    dL/dz_j = (e_j / D) ([u_j > 0] g_j - sgn(u_j) δ),   g_j = dL/dp_j,  δ = Σ_i g_i p_i,

with e_j = e^{z_j - M} (the shift cancels in e_j / D), δ = rowsum(dO ∘ O) as in FlashAttention's
backward, and ReLU'(0) = sgn(0) = 0 (autograd's conventions).  A NaN logit makes its row NaN.

The attention runs on the blockwise driver (:func:`attnscale.kernels.rowwise.softpick_attention`)
with this module's per-row steps (:data:`RULE`), in attnscale's compiled kernels for float32 on the
CPU and in PyTorch elsewhere.  This module imports no kernel driver, so the statistics module can
import its formulas.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnscale.kernels import native

# ε in the denominator, "a small constant for safety" (Zuhri et al. 2025; the authors' default).
SOFTPICK_EPS = 1e-8


def _shift(z: Tensor) -> Tensor:
    """M = max(0, row max of z), (..., 1); NaN for a row holding NaN.  No gradient: the weights
    do not depend on it."""
    if z.shape[-1] == 0:  # no key at all
        return z.new_zeros(*z.shape[:-1], 1)
    m = z.detach().amax(dim=-1, keepdim=True)
    return torch.where(m > 0, m, torch.zeros_like(m)).where(~m.isnan(), m)


def softpick_parts(z: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(u, D, e, M)`` of masked logits z (..., n) (-inf = masked): u = e^{z - M} - e^{-M} (the
    rectified numerator before the ReLU), D the shifted denominator (..., 1), e = e^{z - M}, M
    the shift (..., 1).  Differentiable in z; the weights are ``max(u, 0) / D``."""
    m = _shift(z)
    e = torch.exp(z - m)                                          # 0 at masked keys
    c = torch.exp(-m)
    u = e - c
    absu = torch.where(torch.isneginf(z), torch.zeros_like(u), u.abs())  # masked keys left out
    d = absu.sum(dim=-1, keepdim=True) + SOFTPICK_EPS * c
    return u, d, e, m


def softpick_weights(z: Tensor) -> Tensor:
    """Softpick weights of masked logits z (..., n) (-inf = masked): (..., n), differentiable.
    A row without keys, or whose logits are all <= 0, is all zero."""
    u, d, _, _ = softpick_parts(z)
    return torch.relu(u) / d


class SoftpickRule:
    """Softpick's per-row steps for :func:`attnscale.kernels.rowwise.row_attention` (a
    :class:`~attnscale.kernels.rowwise.RowRule`)."""

    needs_delta = True

    def native(self, z: Tensor) -> bool:
        return z.dtype == torch.float32 and z.device.type == "cpu" and native.available()

    def weights(self, z: Tensor, limit: Tensor | None, out: Tensor) -> tuple[Tensor, object]:
        if limit is not None or self.native(z):
            stats = z.new_empty(*z.shape[:-1], 2)                 # (M, D) per row
            return native.softpick_probs(z, stats, out=out, limit=limit), stats
        u, d, _, m = softpick_parts(z)
        return torch.relu_(u).div_(d), (m, d)

    def grad(self, z: Tensor, p: Tensor, aux: object, dp: Tensor, delta: Tensor | None,
             limit: Tensor | None) -> Tensor:
        if isinstance(aux, Tensor):  # the compiled kernel's (M, D) per row
            return native.softpick_grad(z, dp, aux, delta, limit=limit)
        m, d = aux
        e = torch.exp(z - m)                                      # e^{z - M}, 0 where masked
        u = e - torch.exp(-m)
        # dz = (e / D) ([u > 0] g - sgn(u) δ)
        dz = torch.where(u > 0, dp, torch.zeros_like(dp)).sub_(torch.sign(u).mul_(delta))
        return dz.mul_(e.div_(d))


RULE = SoftpickRule()
