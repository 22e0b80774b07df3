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
from attnscale.precision import upcast

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
        with torch.autocast(w.device.type, enabled=False):
            self._power_iteration(upcast(w), INIT_POWER_ITERS)
            self.gamma = nn.Parameter(self._sigma(upcast(w)).detach().to(w.dtype))

    # Power iteration and σ run in float32 at least (attnscale.precision.upcast) with autocast off,
    # whatever the dtype of the module (u, v may be bf16 buffers) or the autocast state: under bf16
    # autocast the matrix-vector products would otherwise come out bf16 beside float32 u and v.

    @torch.no_grad()
    def _power_iteration(self, w: Tensor, steps: int) -> None:
        u, v = upcast(self.u), upcast(self.v)
        for _ in range(steps):
            v = F.normalize(w.t() @ u, dim=0)
            u = F.normalize(w @ v, dim=0)
        self.v.copy_(v)
        self.u.copy_(u)

    def _sigma(self, w: Tensor) -> Tensor:
        # σ = uᵀ W v with u, v held constant, so dσ/dW = u vᵀ.  Clones, because the next training
        # forward updates the buffers in place before this graph's backward may have run.
        u, v = (upcast(t.clone()) for t in (self.u, self.v))
        return torch.dot(u, w @ v)

    def forward(self, w: Tensor) -> Tensor:
        # The weight returned keeps w's dtype; the layer that uses it casts it as autocast says.
        with torch.autocast(w.device.type, enabled=False):
            w_work = upcast(w)
            if self.training:
                self._power_iteration(w_work.detach(), 1)
            return ((self.gamma / self._sigma(w_work)) * w_work).to(w.dtype)


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
