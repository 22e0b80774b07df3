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

**Where the factor goes** (one :class:`ClipSite` per attention layer, each a list of
:class:`~attnscale.families.ClipTarget` rows per side):

* attnscale's own attention (MultiHeadAttention, the LM): the rows of W_Q and W_K of each head.
* A Hugging Face layer: where its family's projection layout (:mod:`attnscale.families`, the one
  family table) puts each head's q and k rows -- separate projections (Llama; BERT's
  ``query``/``key``; T5's ``q``/``k``, whose logits carry no 1/√d and whose relative position
  bias is the model's and is not rescaled), their biases too (Qwen2, BERT: q = W x + b, so b
  scales with its rows), or a fused projection (GPT-2's Conv1D ``c_attn``, Phi-3's ``qkv_proj``,
  GPT-NeoX's per-head interleaved ``query_key_value``; its v rows are left alone).  RoPE and
  Llama 4's temperature tuning are linear in q and k, so the logits scale exactly.  A soft-cap
  acts after the scale: S_max is taken *before* the cap (the logit the cap bounds).
* Multi-head latent attention (DeepSeek-V2/V3, Megatron Core's MLA rule): per head, the q_nope
  rows of ``q_b_proj`` (or ``q_proj``) by η^α, the q_pe rows by η, the k_nope rows of
  ``kv_b_proj`` by η^(1-α); the rotary key shared by every head (``kv_a_proj_with_mqa``) is left
  alone, and every logit q_nope·k_nope + q_pe·k_pe is multiplied by η.
* q and k normalised after the projection (the family's ``qk_norm``): the norm undoes any
  rescaling of W_Q, W_K, so its gain (and a LayerNorm's bias) is scaled instead: per head where
  the norm is over the full width (OLMo 2: one gain per head and channel); where one gain over
  d serves every head (Qwen3, Gemma 3), by the layer's smallest η (every head still ends <= τ,
  the others lose more than they need).  A gain written as 1 + w (Gemma) is handled as such.
* Refused, each with a one-line :class:`~attnscale.errors.ConfigError`: a family not in the
  table or whose row refuses the clip, a q/k norm without a gain (Llama 4's L2 norm, nanochat),
  an attnscale mechanism that normalises q and k itself (qknorm, cosine...; its gain owns the
  temperature), a model that already carries the ``qk-clip`` mechanism (it would clip twice) and
  parametrised weights (sigma-reparam).

**Data parallelism.**  When ``torch.distributed`` is initialised, S_max of every layer is
all-reduced with MAX (one collective per step) before the factors are formed, so every replica
applies the same factors and the weights stay identical.  Sharded parameters (FSDP2's
``fully_shard``, DTensor): each rank scales the rows of its local shard by their heads' factors
(a head's rows may span ranks), after that all-reduce, so the sharded weights equal the unsharded
clip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attnscale.errors import ConfigError
from attnscale.families import (
    ClipTarget, bypassing_layers, facts, family_of, is_attention_layer,
)
from attnscale.mechanisms import Mechanism
from attnscale.mechanisms.qk_clip import QKClip

def scales_with_weights(mechanism: Mechanism) -> bool:
    """Whether the mechanism's logits are scale · q kᵀ of the projected q and k themselves (or a
    soft-cap of it), so that rescaling W_Q and W_K rescales them: what the mechanism declares
    (``bilinear``: q and k untouched, a scale independent of them; not ``normalises_qk``)."""
    return mechanism.bilinear and not mechanism.normalises_qk


@dataclass
class ClipSite:
    """One attention layer's query- and key-side rows to rescale, head by head.

    ``q`` and ``k`` are :class:`~attnscale.families.ClipTarget` lists: each maps the features of
    one tensor to their head (query heads on the ``q`` side, key heads on the ``k`` side).
    ``shared``: the targets serve every head at once (a per-head-dim norm gain), so one factor
    for the layer.
    """

    name: str
    n_heads: int
    n_kv_heads: int
    d_head: int
    q: list[ClipTarget] = field(default_factory=list)
    k: list[ClipTarget] = field(default_factory=list)
    shared: bool = False
    where: str = "W_Q, W_K"  # what is rescaled, for the docs and records

    def factors(self, s_max: Tensor, tau: float, rtol: float = 0.0) -> tuple[Tensor, Tensor]:
        """(η per query head (H,), η per key head (Hk,)), float64: the group rule above.  A group
        is over τ when its largest S exceeds τ · (1 + ``rtol``) (strict mode's rounding
        tolerance, :func:`attnscale.guard.core.strict_rtol`; 0 in K2's mode)."""
        groups = self.n_heads // self.n_kv_heads
        peak = s_max.view(self.n_kv_heads, groups).amax(dim=1)  # (Hk,) the group's largest S
        # NaN and -inf (a head never observed) are not over τ.
        eta = torch.where(peak > tau * (1.0 + rtol), tau / peak, torch.ones_like(peak))
        if self.shared:
            eta = eta.amin().expand(self.n_kv_heads)
        return eta.repeat_interleave(groups), eta

    @torch.no_grad()
    def apply(self, eta_q: Tensor, eta_k: Tensor, alpha: float) -> None:
        """Multiply the query side by η_q^α and the key side by η_k^(1-α), per head (a target
        with ``power="full"`` by η itself); rows of heads at 1 and rows of no head are
        multiplied by exactly 1.0 (bit for bit unchanged).  A sharded (DTensor) parameter has the
        factors of the global rows its local shard holds applied to that shard."""
        for targets, eta, power in ((self.q, eta_q, alpha), (self.k, eta_k, 1.0 - alpha)):
            for target in targets:
                c = eta ** (power if target.power == "side" else 1.0)   # per head
                rows = target.rows.to(c.device)
                per_row = torch.ones(len(rows), dtype=c.dtype, device=c.device)
                mine = rows >= 0
                per_row[mine] = c[rows[mine]]
                w, local = target.tensor, target.tensor
                if _is_dtensor(w):
                    local, (start, size) = w.to_local(), _local_span(w, target.dim)
                    per_row = per_row[start:start + size]
                shape = [1] * local.dim()
                shape[target.dim] = len(per_row)
                f = per_row.to(device=local.device, dtype=local.dtype).view(shape)
                if target.offset:
                    local.add_(target.offset).mul_(f).sub_(target.offset)
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
    rows = torch.arange(h).repeat_interleave(d)  # head of each row of W_Q, W_K
    for side, linear in ((site.q, module.w_q), (site.k, module.w_k)):
        side.append(ClipTarget(linear.weight, 0, rows))
        if linear.bias is not None:
            side.append(ClipTarget(linear.bias, 0, rows))
    return site


def _hf_site(name: str, module: nn.Module) -> ClipSite:
    """A Hugging Face attention layer: the rows its family's layout (or q/k norm) puts per head."""
    try:
        f = facts(module)
    except ConfigError as err:
        raise ConfigError(f"qk_clip: {name}: {err}") from None
    mech = getattr(module, "attnscale_mechanism", None)
    if isinstance(mech, Mechanism) and not scales_with_weights(mech):
        raise ConfigError(f"qk_clip: {name} runs attnscale mechanism {mech.name!r}, which "
                          "normalises q and k: rescaling W_Q and W_K changes no logit.")
    why = f.refusal or f.clip_refusal
    if why is not None:
        raise ConfigError(f"qk_clip: {name} ({f.family}): {why}")
    if any(hasattr(m, "parametrizations") for m in module.modules()):
        raise ConfigError(f"qk_clip: {name} has parametrised weights; it cannot rescale them "
                          "in place.")
    h, hk, d = f.n_heads, f.n_kv_heads, f.d_head
    site = ClipSite(name, h, hk, d)
    if f.qk_norm is None:
        site.q, site.k = family_of(module).layout.clip_targets(module, f.family)
        return site
    # A norm after the projection: W_Q and W_K are normalised away, the gains set the scale.
    norm = f.qk_norm
    if norm.gain is None:
        raise ConfigError(f"qk_clip: {name} ({f.family}) normalises q and k without a gain "
                          f"({norm.kind}), so rescaling W_Q and W_K changes no logit and there "
                          "is no gain to clip.")
    offset = 1.0 if norm.gain == "1+w" else 0.0
    site.shared = norm.over == "head"
    for attr, heads, side in ((norm.q, h, site.q), (norm.k, hk, site.k)):
        layer_norm = getattr(module, attr)
        for tensor in (layer_norm.weight, getattr(layer_norm, "bias", None)):
            if tensor is None:
                continue
            width = d if site.shared else heads * d
            if tensor.dim() != 1 or tensor.numel() != width:
                raise ConfigError(f"qk_clip: {name} ({f.family}): a {attr} of "
                                  f"{tensor.numel()} channels is not the {width} its family's "
                                  f"norm over the {norm.over} has.")
            rows = torch.zeros(d, dtype=torch.int64) if site.shared else \
                torch.arange(heads).repeat_interleave(d)
            # a LayerNorm's bias scales with its gain; "1 + w" applies to the gain alone
            side.append(ClipTarget(tensor, 0, rows, "side",
                                   offset if tensor is layer_norm.weight else 0.0))
    site.where = f"{norm.q}, {norm.k} gains"
    return site


def clip_sites(model: nn.Module) -> list[ClipSite]:
    """The :class:`ClipSite` of every attention layer of ``model`` (module order).

    Raises:
        ConfigError: a layer the clip cannot handle (see the module doc), or no attention layer.
    """
    own = bypassing_layers(model)
    if own:
        raise ConfigError(f"qk_clip: {own[0][0]} ({own[0][1]}) forms its softmax itself, not "
                          "through transformers' AttentionInterface, so the clip cannot see "
                          "its logits.")
    sites = []
    for name, module in model.named_modules():
        name = name or type(model).__name__
        if isinstance(module, Mechanism):
            continue
        if isinstance(getattr(module, "mechanism", None), Mechanism) and hasattr(module, "w_q"):
            sites.append(_mechanism_site(name, module))
        elif is_attention_layer(module):
            sites.append(_hf_site(name, module))
    if not sites:
        raise ConfigError(f"qk_clip: {type(model).__name__} has no attention layer whose W_Q "
                          "and W_K the clip can find (attnscale's MultiHeadAttention or LM, or a "
                          "Hugging Face model whose attention goes through transformers' "
                          "AttentionInterface).")
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
