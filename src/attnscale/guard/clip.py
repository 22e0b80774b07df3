"""QK-Clip on any model the guard can see: where each layer's temperature lives, and the clip.

QK-Clip (Kimi Team 2025, "Kimi K2", arXiv 2507.20534, the clip of MuonClip): after an optimizer
step, a head h whose largest pre-softmax logit S_max^h since the last clip exceeds τ is rescaled
so that, with the weights that logit was measured at, it becomes τ: γ_h = min(1, τ / S_max^h),
split as γ^α on the query side and γ^(1-α) on the key side (K2: τ = 100, α = 0.5).

**Grouped-query attention.**  With H query heads and Hk key heads, query heads
``g · H/Hk ... (g + 1) · H/Hk - 1`` share key head g, whose rows must be rescaled once.  The rule
(Megatron Core's, ``SelfAttention.clip_qk`` with ``_clip_linear_qkv`` in
megatron/core/transformer/attention.py): per group, η_g = min(1, τ / max_{h in g} S_max^h); every
query head of the group is multiplied by η_g^α and the shared key head by η_g^(1-α).  Every logit
of head h in g is then multiplied by η_g, so its largest becomes S_max^h · η_g <= τ (equal for the
group's largest head, below for the others): **every** query head ends at or below τ, and a group
none of whose heads exceeds τ is untouched.  Multi-head attention is the case of
groups of one, K2's own rule.

**Where the factor goes** (one :class:`ClipSite` per attention layer):

* q and k are linear in W_Q and W_K (attnscale's MultiHeadAttention and LM; HF Llama, Mistral,
  Qwen2, Gemma 2): the rows of W_Q and W_K of each head, **and their biases** (Qwen2), are scaled;
  RoPE is linear, so the logits scale exactly.  Gemma 2's soft-cap acts after the scale: S_max is
  taken *before* the cap (the logit the cap bounds), so the clip still sees its growth.
* q and k pass through a norm after the projection (Qwen3, Gemma 3: an RMSNorm over each head's
  d channels whose gain all heads share; OLMo 2: one over all H · d channels).  The norm undoes any
  rescaling of W_Q, W_K, so the gain is scaled instead: per head where it is per head (OLMo 2);
  where one gain serves every head, by the layer's smallest η (every head still ends <= τ, the
  others lose more than they need).  A gain written as 1 + w (Gemma) is handled as such.
* Refused, each with a one-line :class:`~attnscale.errors.ConfigError`: multi-head latent
  attention (DeepSeek-V3; q and k come from shared latent projections), an attnscale mechanism that
  normalises q and k itself (qknorm, cosine...; its gain owns the temperature), a model that
  already carries the ``qk-clip`` mechanism (it would clip twice) and parametrised weights
  (sigma-reparam).

**Data parallelism.**  When ``torch.distributed`` is initialised, S_max of every layer is
all-reduced with MAX (one collective per step) before the factors are formed, so every replica
applies the same factors and the weights stay identical.  Sharded parameters (FSDP2's
``fully_shard``, DTensor): each rank scales the rows of its local shard by their heads' factors
(a head's rows may span ranks), after that all-reduce, so the sharded weights equal the unsharded
clip.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attnscale.errors import ConfigError
from attnscale.mechanisms import Mechanism
from attnscale.mechanisms.qk_clip import QKClip

def scales_with_weights(mechanism: Mechanism) -> bool:
    """Whether the mechanism's logits are scale · q kᵀ of the projected q and k themselves (or a
    soft-cap of it), so that rescaling W_Q and W_K rescales them: what the mechanism declares
    (``bilinear``: q and k untouched, a scale independent of them; not ``normalises_qk``)."""
    return mechanism.bilinear and not mechanism.normalises_qk


# Attribute names of multi-head latent attention (DeepSeek-V2/V3 in transformers).
_MLA_ATTRS = ("kv_a_proj_with_mqa", "q_a_proj", "kv_b_proj")


@dataclass
class ClipSite:
    """One attention layer's query- and key-side tensors to rescale, head by head.

    Each entry of ``q``/``k`` is ``(tensor, dim, heads, offset)``: ``dim`` of ``tensor`` holds
    ``heads`` blocks of ``d_head`` features (query heads for ``q``, key heads for ``k``); a gain
    written ``1 + w`` has ``offset = 1`` (scaled as ``w <- c (1 + w) - 1``).  ``shared``: the
    tensors serve every head at once (a per-head-dim norm gain), so one factor for the layer.
    """

    name: str
    n_heads: int
    n_kv_heads: int
    d_head: int
    q: list[tuple[Tensor, int, int, float]] = field(default_factory=list)
    k: list[tuple[Tensor, int, int, float]] = field(default_factory=list)
    shared: bool = False
    where: str = "W_Q, W_K"  # what is rescaled, for the docs and records

    def factors(self, s_max: Tensor, tau: float) -> tuple[Tensor, Tensor]:
        """(η per query head (H,), η per key head (Hk,)), float64: the group rule above."""
        groups = self.n_heads // self.n_kv_heads
        peak = s_max.view(self.n_kv_heads, groups).amax(dim=1)  # (Hk,) the group's largest S
        # NaN and -inf (a head never observed) are not over τ.
        eta = torch.where(peak > tau, tau / peak, torch.ones_like(peak))
        if self.shared:
            eta = eta.amin().expand(self.n_kv_heads)
        return eta.repeat_interleave(groups), eta

    @torch.no_grad()
    def apply(self, eta_q: Tensor, eta_k: Tensor, alpha: float) -> None:
        """Multiply the query side by η_q^α and the key side by η_k^(1-α), per head; heads at 1
        are multiplied by exactly 1.0 (bit for bit unchanged).  A sharded (DTensor) parameter has
        the factors of the global rows its local shard holds applied to that shard."""
        for targets, eta, power in ((self.q, eta_q, alpha), (self.k, eta_k, 1.0 - alpha)):
            for w, dim, heads, offset in targets:
                c = eta ** power
                if self.shared:
                    c = c[:1]
                per_row = c.repeat_interleave(w.shape[dim] // len(c))  # (features along dim,)
                local = w
                if _is_dtensor(w):
                    local, (start, size) = w.to_local(), _local_span(w, dim)
                    per_row = per_row[start:start + size]
                shape = [1] * local.dim()
                shape[dim] = len(per_row)
                f = per_row.to(device=local.device, dtype=local.dtype).view(shape)
                if offset:
                    local.add_(offset).mul_(f).sub_(offset)
                else:
                    local.mul_(f)


def _is_dtensor(t: Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _local_span(w: Tensor, dim: int) -> tuple[int, int]:
    """(first global index, length) along ``dim`` of the local shard of DTensor ``w``: FSDP2's
    ``fully_shard`` splits dim 0 across ranks, so a head's rows may lie on two ranks."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
    return offset[dim], shape[dim]


def _gain_offset(norm: nn.Module) -> float:
    """0 when ``norm`` multiplies by its weight, 1 when by ``1 + weight`` (Gemma's RMSNorm): read
    from what the norm does with a zero weight (a copy; the model is not touched)."""
    probe = copy.deepcopy(norm).float()
    with torch.no_grad():
        probe.weight.zero_()
        x = torch.ones(1, probe.weight.numel())
        out = probe(x)
    return 1.0 if bool(out.abs().amax() > 0.5) else 0.0


def _mechanism_site(name: str, module: nn.Module) -> ClipSite:
    """attnscale's own attention (MultiHeadAttention, the LM's attention): w_q, w_k, mechanism."""
    mech = module.mechanism
    if isinstance(mech, QKClip):
        raise ConfigError(f"qk_clip: {name} already runs the 'qk-clip' mechanism, which clips "
                          "after every step itself; use the guard without qk_clip, or a 'scaled' "
                          "model.")
    if not scales_with_weights(mech):
        raise ConfigError(f"qk_clip: {name} runs mechanism {mech.name!r}, whose logits do not "
                          "scale with W_Q and W_K (it normalises q and k, reparametrises the "
                          "weights, adds a logit bias or splits q and k into two maps); its own "
                          "rule owns the temperature.")
    for linear in (module.w_q, module.w_k):
        if hasattr(linear, "parametrizations"):
            raise ConfigError(f"qk_clip: {name} has parametrised W_Q/W_K; it cannot rescale "
                              "them in place.")
    h, d = module.n_heads, module.d_head
    site = ClipSite(name, h, h, d)
    for side, linear in ((site.q, module.w_q), (site.k, module.w_k)):
        side.append((linear.weight, 0, h, 0.0))
        if linear.bias is not None:
            side.append((linear.bias, 0, h, 0.0))
    return site


def _hf_site(name: str, module: nn.Module) -> ClipSite:
    """A Hugging Face attention layer: q_proj, k_proj (+ biases), optional q_norm / k_norm."""
    config = getattr(module, "config", None)
    family = getattr(config, "model_type", type(module).__name__)
    mech = getattr(module, "attnscale_mechanism", None)
    if isinstance(mech, Mechanism) and not scales_with_weights(mech):
        raise ConfigError(f"qk_clip: {name} runs attnscale mechanism {mech.name!r}, which "
                          "normalises q and k: rescaling W_Q and W_K changes no logit.")
    h = int(getattr(config, "num_attention_heads", 0) or 0)
    hk = int(getattr(config, "num_key_value_heads", None) or h)
    d = int(module.head_dim)
    q_proj, k_proj = module.q_proj, module.k_proj
    if not (h and hk and h % hk == 0 and q_proj.weight.shape[0] == h * d
            and k_proj.weight.shape[0] == hk * d):
        raise ConfigError(f"qk_clip: cannot read {h} query / {hk} key heads of {d} channels off "
                          f"{name} ({family}); the clip cannot handle this layout.")
    site = ClipSite(name, h, hk, d)
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if (q_norm is None) != (k_norm is None):
        raise ConfigError(f"qk_clip: {name} ({family}) normalises only one of q and k; the clip "
                          "cannot split its factor there.")
    if q_norm is None:
        for side, linear, heads in ((site.q, q_proj, h), (site.k, k_proj, hk)):
            side.append((linear.weight, 0, heads, 0.0))
            if linear.bias is not None:  # Qwen2: q = W x + b, so b scales with the rows
                side.append((linear.bias, 0, heads, 0.0))
        return site
    # A norm after the projection: W_Q and W_K are normalised away, the gains set the scale.
    for norm, heads, side in ((q_norm, h, site.q), (k_norm, hk, site.k)):
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 1:
            raise ConfigError(f"qk_clip: {name} ({family}) normalises q and k with "
                              f"{type(norm).__name__}, which has no gain to clip; rescaling W_Q "
                              "and W_K would change no logit.")
        if weight.numel() == d:
            site.shared = True   # Qwen3, Gemma 3: one gain per channel, shared by all heads
        elif weight.numel() != heads * d:
            raise ConfigError(f"qk_clip: {name} ({family}): a q/k norm gain of "
                              f"{weight.numel()} channels fits neither {d} nor {heads} x {d}.")
        side.append((weight, 0, 1 if weight.numel() == d else heads, _gain_offset(norm)))
    site.where = "q_norm, k_norm gains"
    return site


def clip_sites(model: nn.Module) -> list[ClipSite]:
    """The :class:`ClipSite` of every attention layer of ``model`` (module order).

    Raises:
        ConfigError: a layer the clip cannot handle (see the module doc), or no attention layer.
    """
    sites = []
    for name, module in model.named_modules():
        name = name or type(model).__name__
        if any(hasattr(module, a) for a in _MLA_ATTRS):
            raise ConfigError(f"qk_clip: {name} is multi-head latent attention (DeepSeek-V3), "
                              "whose q and k come from shared latent projections; not supported.")
        if isinstance(module, Mechanism):
            continue
        if isinstance(getattr(module, "mechanism", None), Mechanism) and hasattr(module, "w_q"):
            sites.append(_mechanism_site(name, module))
        elif (isinstance(getattr(module, "q_proj", None), nn.Linear)
              and isinstance(getattr(module, "k_proj", None), nn.Linear)
              and getattr(module, "head_dim", None)):
            sites.append(_hf_site(name, module))
    if not sites:
        raise ConfigError(f"qk_clip: {type(model).__name__} has no attention layer whose W_Q "
                          "and W_K the clip can find (attnscale's MultiHeadAttention or LM, or a "
                          "Hugging Face model with q_proj and k_proj).")
    return sites


def all_reduce_max(values: Tensor) -> Tensor:
    """``values`` all-reduced with MAX across the processes of ``torch.distributed`` when it is
    initialised (every replica then clips alike); unchanged otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    out = values.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out
