"""``sigma-reparam``: σReparam (Zhai et al. 2023), W ↦ (γ / σ(W)) · W on W_Q and W_K.

σ(W) is the spectral norm, estimated by power iteration: one step per training forward, with the
singular-vector estimates u, v kept as buffers across steps (as in Miyato et al.'s spectral norm).
γ is learned and starts at the estimate of σ(W_0), so the reparametrised weight is W_0 at init.
Bounding the spectral norm of W_Q and W_K bounds the logit scale, which prevents attention entropy
collapse.
The logit rule itself is ``scaled``; as a bare module (no projections) it is exactly ``scaled``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Power-iteration steps at construction, so σ(W_0) starts near converged (torch's spectral_norm
# does 15; these are cheap, once); afterwards one step per training forward.
INIT_POWER_ITERS = 50


class SigmaReparam(nn.Module):
    """W ↦ (γ / σ(W)) W, a parametrisation for ``torch.nn.utils.parametrize``."""

    def __init__(self, weight: Tensor):
        super().__init__()
        w = weight.detach()
        self.register_buffer("u", F.normalize(w.new_empty(w.shape[0]).normal_(), dim=0))
        self.register_buffer("v", F.normalize(w.new_empty(w.shape[1]).normal_(), dim=0))
        self._power_iteration(w, INIT_POWER_ITERS)
        self.gamma = nn.Parameter(self._sigma(w).detach())

    @torch.no_grad()
    def _power_iteration(self, w: Tensor, steps: int) -> None:
        for _ in range(steps):
            self.v.copy_(F.normalize(w.t() @ self.u, dim=0))
            self.u.copy_(F.normalize(w @ self.v, dim=0))

    def _sigma(self, w: Tensor) -> Tensor:
        # σ = uᵀ W v with u, v held constant, so dσ/dW = u vᵀ.  Clones, because the next training
        # forward updates the buffers in place before this graph's backward may have run.
        return torch.dot(self.u.clone(), w @ self.v.clone())

    def forward(self, w: Tensor) -> Tensor:
        if self.training:
            self._power_iteration(w.detach(), 1)
        return (self.gamma / self._sigma(w)) * w


@register("sigma-reparam")
class SigmaReparamMechanism(Mechanism):
    """z = qᵀk / √d with W_Q, W_K → (γ/σ(W)) W.  Source: Zhai et al. 2023, σReparam."""

    defined_at_init = False  # the temperature lives in W_Q and W_K, not in a rule on q and k

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    def init_projections(self, w_q: nn.Linear, w_k: nn.Linear) -> None:
        for linear in (w_q, w_k):
            # unsafe=True only skips torch's trial evaluation, which in training mode would take a
            # power-iteration step and move σ off γ, so Ŵ would not start at exactly W_0.
            parametrize.register_parametrization(linear, "weight", SigmaReparam(linear.weight),
                                                 unsafe=True)
