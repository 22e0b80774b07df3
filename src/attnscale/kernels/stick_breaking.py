"""Stick-breaking attention (Tan et al. 2024, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study", arXiv 2410.17980): each key j a query attends takes the share
β_j = σ(z_j) of the stick its nearer keys left over,

    p_j = β_j Π_{k > j} (1 - β_k),

the product over the attended keys nearer to the query (a larger key index: under causality the
keys j < k <= i of query i; without it every key, the query taken to follow them all).  Masked
keys have β = 0 and take nothing.  Rows sum to 1 - Π_k (1 - β_k) <= 1: what is left of the stick
is attended to nothing.  The order of the keys is the only position the weights see, so the
mechanism needs no positional encoding.

In log space, as the paper computes it (σ(-z) = e^{-softplus(z)}):

    log p_j = log σ(z_j) - Σ_{k > j} softplus(z_k),

a suffix sum over each row's keys, exact within a block of whole rows; every p_j = e^{log p_j} <=
1, so nothing overflows.  Gradient, with g_j = dL/dp_j:

    dL/dz_k = g_k p_k (1 - β_k) - β_k Σ_{j < k} g_j p_j,

a prefix sum over the row (p_j depends on z_k for every nearer k through the factor 1 - β_k).
A NaN logit makes its row NaN (its weight and every farther key's are NaN).

The attention runs on the blockwise driver
(:func:`attnscale.kernels.rowwise.stick_breaking_attention`) with this module's per-row steps
(:data:`RULE`), in attnscale's compiled kernels for float32 on the CPU and in PyTorch elsewhere.
This module imports no kernel driver, so the statistics module can import its formulas.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnscale.kernels import native


def softplus(z: Tensor) -> Tensor:
    """log(1 + e^z) = max(z, 0) + log1p(e^{-|z|}), exact for every z (0 at -inf); NaN stays."""
    return torch.relu(z) + torch.log1p(torch.exp(-z.abs()))


def suffix_after(x: Tensor) -> Tensor:
    """Σ_{k > j} x_k along the last dimension, (..., n): a reversed cumulative sum shifted by
    one, so nothing is formed as a difference of two sums."""
    incl = x.flip(-1).cumsum(-1).flip(-1)                         # Σ_{k >= j}
    return F.pad(incl[..., 1:], (0, 1))


def prefix_before(x: Tensor) -> Tensor:
    """Σ_{k < j} x_k along the last dimension, (..., n)."""
    return F.pad(x.cumsum(-1)[..., :-1], (1, 0))


def stick_breaking_log_weights(z: Tensor) -> Tensor:
    """log p of masked logits z (..., n) (-inf = masked; keys in order, the nearest last):
    (..., n), -inf at masked keys; differentiable."""
    sp = softplus(z)
    return (z - sp) - suffix_after(sp)                            # log σ(z_j) - Σ_{k>j} sp(z_k)


def stick_breaking_weights(z: Tensor) -> Tensor:
    """Stick-breaking weights of masked logits z (..., n): (..., n), differentiable; 0 at
    masked keys and for a row without keys."""
    return torch.exp(stick_breaking_log_weights(z))


class StickBreakingRule:
    """Stick-breaking's per-row steps for :func:`attnscale.kernels.rowwise.row_attention` (a
    :class:`~attnscale.kernels.rowwise.RowRule`)."""

    needs_delta = False

    def native(self, z: Tensor) -> bool:
        return z.dtype == torch.float32 and z.device.type == "cpu" and native.available()

    def weights(self, z: Tensor, limit: Tensor | None, out: Tensor) -> tuple[Tensor, object]:
        if limit is not None or self.native(z):
            return native.stick_breaking_probs(z, out=out, limit=limit), None
        return stick_breaking_weights(z), None

    def grad(self, z: Tensor, p: Tensor, aux: object, dp: Tensor, delta: Tensor | None,
             limit: Tensor | None) -> Tensor:
        if limit is not None or self.native(z):
            return native.stick_breaking_grad(z, p, dp, limit=limit)
        gp = dp.mul_(p)                                           # g_j p_j
        beta = torch.sigmoid(z)
        # dz_k = g_k p_k (1 - β_k) - β_k Σ_{j<k} g_j p_j
        return prefix_before(gp).mul_(beta).neg_().add_(gp * torch.sigmoid(-z))


RULE = StickBreakingRule()
