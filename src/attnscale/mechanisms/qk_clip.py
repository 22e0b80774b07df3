"""``qk-clip``: QK-Clip from MuonClip (Kimi Team 2025, "Kimi K2", arXiv 2507.20534).

The logits are ``scaled``'s, z = qᵀk / √d; the mechanism acts on the weights, between steps:

* each head h tracks S_max^h, its largest pre-softmax logit (signed, over the keys each query
  attends: padding and any other mask, and causality, are left out) in the attention calls made
  in training mode since the last clip: the pipeline hands every call's prepared q, k and mask to
  :meth:`QKClip.track_logits`, which scores q kᵀ once more, block by block, for the maximum
  alone.  Every train-mode call counts, so measure in ``eval()``;
* after the optimizer step, a head with S_max^h > τ gets γ_h = τ / S_max^h, and its rows of W_Q
  and W_K are multiplied by γ_h^α and γ_h^(1-α); heads at or below τ are left untouched.
  K2 uses τ = 100 and α = 0.5, i.e. √γ_h on each of W_Q and W_K.

Rescaling W_Q's rows of head h by γ^α (bias too, so q_h itself scales by γ^α) and W_K's by γ^(1-α)
multiplies every logit of head h by exactly γ_h: with the weights S_max was measured at, the head's
largest logit on those inputs becomes exactly τ.  As in K2, S_max comes from the forward passes
*before* the step and the factor is applied to the weights *after* it, so the step's own update is
not measured: at a large learning rate a head can exceed τ on the same batch by what one step adds
(the next clip catches it).  For a strict bound after every step, measure after the step instead:
``optimizer.step(); mech.reset(); model(batch)`` in training mode, under ``torch.no_grad()``,
then ``mech.clip()``: one extra forward per step.

It acts on weights, like ``init-reparam``, so it needs the projections:
:class:`attnscale.attention.MultiHeadAttention` hands them over through :meth:`init_projections`
(any model built on it works); a model with its own layout calls :meth:`QKClip.bind` and
:meth:`QKClip.observe`.  Run the clip after every optimizer step, with a hook or by hand::

    attnscale.mechanisms.qk_clip.install(optimizer, model)   # once, after building the optimizer

or ``for m in model.modules(): isinstance(m, QKClip) and m.clip()`` after ``optimizer.step()``.
attnscale's trainers use :func:`install` (an optimizer step post-hook).  Under data parallelism
each process sees its own batch: all-reduce ``s_max`` with MAX before the clip, or the replicas'
weights drift apart.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from attnscale.errors import ConfigError, check_float
from attnscale.kernels.peak import head_peaks
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Kimi K2's threshold on the max logit and its split of γ between W_Q and W_K (arXiv 2507.20534).
K2_TAU = 100.0
K2_ALPHA = 0.5
# Logits scored per block while tracking S_max: (B, H, rows, Nk) float32 blocks of at most
# 2^22 entries (16 MiB), so the tracking never holds the (B, H, Nq, Nk) logits at once.
TRACK_BLOCK_ELEMENTS = 1 << 22


@register("qk-clip")
class QKClip(Mechanism):
    """z = qᵀk / √d; after each step W_Q^h, W_K^h ← γ^α W_Q^h, γ^(1-α) W_K^h with
    γ = min(1, τ / S_max^h), τ = 100, α = 0.5.  Source: Kimi K2 (arXiv 2507.20534), QK-Clip."""

    # The temperature lives in W_Q and W_K (rescaled during training): at init the rule is scaled.
    defined_at_init = False

    def __init__(self, d_head: int, n_heads: int, *, tau: float = K2_TAU,
                 alpha: float = K2_ALPHA):
        super().__init__(d_head, n_heads)
        self.tau = check_float("tau", tau, positive=True)
        self.alpha = check_float("alpha", alpha)
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1], got {alpha!r}.")
        # S_max per head since the last clip; -inf before any logit.  float64 whatever the model's
        # dtype (see observe), and not saved: it is per-step state, not a weight.
        self.register_buffer("s_max", torch.full((n_heads,), -math.inf, dtype=torch.float64),
                             persistent=False)
        # (tensor, dim) pairs whose dim holds the n_heads * d_head output features of W_Q (_q) and
        # W_K (_k).  A plain list, so the model's weights are not registered here a second time.
        self._q_targets: list[tuple[Tensor, int]] = []
        self._k_targets: list[tuple[Tensor, int]] = []
        # Whether prepare() tracks S_max; off for a model that feeds observe() itself (bind()).
        self.track = True

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    # --- tracking S_max ---------------------------------------------------------------------

    @torch.no_grad()
    def observe(self, z: Tensor) -> None:
        """Fold logits ``z`` (..., H, Nq, Nk), masked entries at -inf, into S_max per head."""
        if z.numel() == 0:
            return
        dims = [d for d in range(z.dim()) if d != z.dim() - 3]
        self._fold(torch.amax(z.detach(), dim=dims))

    def _fold(self, new: Tensor) -> None:
        """S_max ← max(S_max, new), per head; ``new`` (H,) of any float dtype."""
        new = new.to(device=self.s_max.device, dtype=torch.float64)
        # Reassigned rather than updated in place: Module.to(dtype) may have cast the buffer to a
        # half type, which would round S_max (and so γ); float64 holds any logit exactly.
        self.s_max = torch.maximum(self.s_max.to(torch.float64), new)

    def track_logits(self, q: Tensor, k: Tensor, scale: Scale, mask: Tensor | None,
                     causal: bool) -> None:
        """The pipeline's call, right after :meth:`prepare`, with the mask the softmax will use:
        fold this call's largest logit per head into S_max, in training mode only.

        Only the keys each query attends count (:func:`attnscale.kernels.peak.head_peaks`):
        padding, any boolean mask and causality; one extra q kᵀ, scored block by block.
        """
        if self.training and self.track:
            self._fold(head_peaks(q, k, scale, mask=mask, causal=causal,
                                  block_elements=TRACK_BLOCK_ELEMENTS))

    def reset(self) -> None:
        """Forget the logits seen so far (S_max = -inf), as :meth:`clip` does after clipping."""
        self.s_max = torch.full((self.n_heads,), -math.inf, dtype=torch.float64,
                                device=self.s_max.device)

    # --- the clip ---------------------------------------------------------------------------

    def init_projections(self, w_q: nn.Linear, w_k: nn.Linear) -> None:
        for linear in (w_q, w_k):
            if hasattr(linear, "parametrizations"):
                raise ConfigError("qk-clip rescales W_Q and W_K in place; it cannot act on a "
                                  "parametrised weight.")
        self.bind(w_q.weight, w_k.weight, dim=0)  # nn.Linear: (out_features, in_features)
        if w_q.bias is not None:
            self._q_targets.append(self._checked(w_q.bias, 0, "W_Q bias"))
        if w_k.bias is not None:
            self._k_targets.append(self._checked(w_k.bias, 0, "W_K bias"))

    def bind(self, w_q: Tensor, w_k: Tensor, *, dim: int = 0, track: bool = True) -> None:
        """Take W_Q and W_K (parameters or views of them) whose ``dim`` holds the
        n_heads · d_head output features, head by head; replaces any earlier binding.

        ``track=False`` for a model that does not run its attention through ``prepare`` on the
        actual q and k (the recall model's score tables): it calls :meth:`observe` itself.
        """
        self._q_targets = [self._checked(w_q, dim, "W_Q")]
        self._k_targets = [self._checked(w_k, dim, "W_K")]
        self.track = track

    def _checked(self, w: Tensor, dim: int, what: str) -> tuple[Tensor, int]:
        """(w, dim as a non-negative axis), or a ConfigError when that axis is not H · d."""
        if not -w.dim() <= dim < w.dim() or w.shape[dim] != self.n_heads * self.d_head:
            raise ConfigError(f"qk-clip: {what} of shape {tuple(w.shape)} has no "
                              f"n_heads * d_head = {self.n_heads * self.d_head} features along "
                              f"dim {dim}.")
        return w, dim % w.dim()

    @torch.no_grad()
    def clip(self) -> Tensor:
        """Rescale W_Q and W_K of every head whose S_max exceeds τ, then reset S_max.

        Returns γ per head, (H,) float64 (1 where the head was left alone).  Call it after
        ``optimizer.step()`` (:func:`install` does).
        """
        if not self._q_targets:
            raise ConfigError("qk-clip: clip() needs the W_Q and W_K it rescales; build the "
                              "mechanism inside attnscale.MultiHeadAttention (or call "
                              "init_projections / bind) first.")
        s_max = self.s_max.to(torch.float64)
        over = s_max > self.tau  # NaN and -inf (no forward since the last clip) are not over
        gamma = torch.where(over, self.tau / s_max, torch.ones_like(s_max))  # (H,)
        # Every head is multiplied, by exactly 1.0 where it is not over τ (which leaves it
        # bit for bit as it was): no host sync to find the clipped heads.
        for targets, power in ((self._q_targets, self.alpha), (self._k_targets, 1 - self.alpha)):
            for w, dim in targets:
                per_head = w.unflatten(dim, (self.n_heads, self.d_head))  # head axis at dim
                shape = [1] * per_head.dim()
                shape[dim] = self.n_heads
                per_head.mul_((gamma ** power).to(device=w.device, dtype=w.dtype).view(shape))
        self.reset()
        return gamma

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tau={self.tau:g}, alpha={self.alpha:g}"


def clip_mechanisms(model: nn.Module) -> list[QKClip]:
    """Every ``qk-clip`` mechanism inside ``model``."""
    return [m for m in model.modules() if isinstance(m, QKClip)]


def install(optimizer: torch.optim.Optimizer, model: nn.Module) -> RemovableHandle:
    """Run :meth:`QKClip.clip` of every qk-clip mechanism in ``model`` after each
    ``optimizer.step()`` (a step post-hook); returns the hook's handle (``.remove()`` undoes it).

    Raises ConfigError when ``model`` has no qk-clip mechanism or one without its projections.
    """
    mechanisms = clip_mechanisms(model)
    if not mechanisms:
        raise ConfigError(f"{type(model).__name__} has no qk-clip mechanism to install.")
    for m in mechanisms:
        if not m._q_targets:
            raise ConfigError("qk-clip: a mechanism in the model has no W_Q and W_K bound; build "
                              "it inside attnscale.MultiHeadAttention or call bind().")

    def after_step(opt, args, kwargs) -> None:
        for m in mechanisms:
            m.clip()

    return optimizer.register_step_post_hook(after_step)
