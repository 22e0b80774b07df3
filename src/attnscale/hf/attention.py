"""The ``"attnscale"`` entry of transformers' AttentionInterface: HF's attention call on attnscale's
pipeline, with the model's own temperature (:class:`NativeTemperature`) unless a mechanism was
installed by :func:`attnscale.hf.set_mechanism`."""

from __future__ import annotations

import functools
import weakref

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn

from attnscale.attention import attention
from attnscale.errors import ConfigError
from attnscale.families import FAMILIES, family_name, family_of
from attnscale.mechanisms import Mechanism
from attnscale.mechanisms.base import Scale, inv_sqrt
from attnscale.kernels.peak import head_peaks
from attnscale.pipeline import MASKED_BIAS

# The attention implementation name, for from_pretrained(..., attn_implementation=...).
ATTN_IMPLEMENTATION = "attnscale"
# Attribute (and state_dict prefix) of the swapped mechanism on each attention layer, and the
# config attribute that records it ({"name": ..., "options": {...}}) for save_pretrained.
MECHANISM_ATTR = "attnscale_mechanism"
# Inkling 2 passes sink logits computed per query (B, H, Nq, 1) under this name.
ROW_SINKS_KWARG = "sinks"
# T5's relative position bias reaches the attention function under this name (HF
# modeling_t5.py); it is added to the logits as the pipeline's ``bias``.
POSITION_BIAS_KWARG = "position_bias"
# gpt-oss passes its learned per-head attention sinks (H,) under this name (HF transformers
# modeling_gpt_oss.py); they are kept, as the pipeline's "sink" normaliser.
SINK_KWARG = "s_aux"
# The mechanism set_mechanism applies at the projections (clip-qkv: OLMo's and DBRX's clamp).
CLIP_QKV = "clip-qkv"
# Oldest transformers whose AttentionInterface / AttentionMaskInterface / sdpa_mask this uses.
MIN_TRANSFORMERS = "5.0"


class NativeTemperature(Mechanism):
    """The model's own temperature: z = scaling · qᵀk, then c · tanh(z / c) when HF passes a cap.

    Not in the registry: its constants come from the model (``module.scaling``, the config's
    ``attn_logit_softcapping``), not from a name.
    """

    def __init__(self, d_head: int, n_heads: int, *, scaling: float, cap: float | None):
        super().__init__(d_head, n_heads)
        self.scaling = float(scaling)
        self.cap = None if cap is None else float(cap)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.scaling:g}, cap={self.cap}"


@functools.lru_cache(maxsize=None)
def _native(d_head: int, n_heads: int, scaling: float, cap: float | None) -> NativeTemperature:
    # One parameter-free instance per distinct temperature, instead of one per call.
    return NativeTemperature(d_head, n_heads, scaling=scaling, cap=cap)


class WithSinks:
    """A rule with the model's own attention sinks: ``rule``'s temperature, then the softmax with
    one sink logit per head (gpt-oss's ``sinks``, passed as ``s_aux``), the pipeline's ``"sink"``
    normaliser.  Everything but the normaliser is ``rule``'s; not an ``nn.Module``, so the sinks
    stay the model's parameter (trained and saved as HF's)."""

    normaliser = "sink"

    def __init__(self, rule: Mechanism, sinks: Tensor):
        if rule.normaliser != "softmax":
            raise ConfigError(f"mechanism {rule.name or type(rule).__name__!r} brings its own "
                              f"{rule.normaliser!r} normaliser; it cannot replace the temperature "
                              "of a model with attention sinks (s_aux).")
        self.rule, self.sinks = rule, sinks

    def __getattr__(self, name: str):
        return getattr(self.rule, name)

    def sink_logits(self) -> Tensor:
        return self.sinks


# Masks attnscale's mask function built for plain top-left causal attention (the masks HF's SDPA
# integration would skip for ``is_causal``), by id: the attention function runs them as
# ``causal=True`` without reading them.  A model that edits such a mask makes a new tensor, which
# is then read as it is.
_CAUSAL_MASKS: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def attnscale_mask(*args, **kwargs) -> Tensor | None:
    """The ``"attnscale"`` entry of HF's AttentionMaskInterface: the mask eager attention would
    get, never less.

    HF's eager attention applies no causality of its own: whatever is causal, windowed, chunked
    or padded is in the mask the model builds (``masking_utils.eager_mask``).  This function builds
    that mask as a boolean one (``sdpa_mask`` without its causal skip), so causality comes from
    the model, never from a default.  A mask that is plain top-left causal is still built (as a
    broadcast view, O(Nq · Nk)) and remembered, so the attention function runs it on the fused
    causal path without reading it.  Families whose code edits eager's float mask (the table's
    ``mask="additive"``: DeepSeek-V4 concatenates 0/-inf blocks onto it) get eager's own mask.
    Arguments are those of ``sdpa_mask``/``eager_mask`` (they differ between transformers
    versions and are passed on as they are).
    """
    from transformers.masking_utils import eager_mask, sdpa_mask

    config = kwargs.get("config")
    row = FAMILIES.get(getattr(config, "model_type", None) or "")
    if row is not None and row.mask == "additive":
        return eager_mask(*args, **kwargs)
    if kwargs.get("allow_is_causal_skip", True):
        if sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": True,
                               "allow_is_bidirectional_skip": False}) is None:
            full = sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False,
                                       "allow_is_bidirectional_skip": False})
            mask = full[:1].expand(full.shape)  # every sequence alike: no padding
            _CAUSAL_MASKS[id(mask)] = mask
            return mask
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


class ProjectionClamp:
    """Forward hook clamping a projection's output to [-clip, clip] (clip-qkv in an HF layer).
    A class, not a closure, so that a copied model (``copy.deepcopy``, pickling) carries hooks
    :func:`unclamp_projections` still recognises."""

    def __init__(self, clip: float):
        self.clip = float(clip)

    def __call__(self, module: nn.Module, inputs: tuple, out: Tensor) -> Tensor:
        return out.clamp(-self.clip, self.clip)


def _projections(layer: nn.Module) -> list[nn.Module]:
    """The q, k and v projections the family's layout names for ``layer``."""
    return list(family_of(layer).layout.projections(layer, family_name(layer)).values())


def clamp_projections(layer: nn.Module, clip: float) -> None:
    """Clamp the outputs of ``layer``'s q, k and v projections (the family's layout names them)
    to [-clip, clip], as OLMo (``clip_qkv`` after each projection) and DBRX (after its fused
    one) do: before any q/k norm and RoPE, so the logits depend on relative positions only.
    Undone by :func:`unclamp_projections`."""
    unclamp_projections(layer)
    for projection in _projections(layer):
        projection.register_forward_hook(ProjectionClamp(clip))


def unclamp_projections(layer: nn.Module) -> None:
    """Remove the hooks of :func:`clamp_projections` (nothing when there are none), also from a
    copy of the model they were installed on."""
    try:
        projections = _projections(layer)
    except ConfigError:  # a family outside the table, or a layout without such projections
        return
    for projection in projections:
        hooks = projection._forward_hooks  # torch keeps a module's forward hooks here
        for key in [k for k, hook in hooks.items() if isinstance(hook, ProjectionClamp)]:
            del hooks[key]


def _masks(attention_mask: Tensor | None, n_q: int, n_k: int
           ) -> tuple[Tensor | None, bool, Tensor | None]:
    """HF's mask as the pipeline's ``(mask, causal, bias)``, as eager reads it.

    None: every key (eager adds nothing).  A mask from :func:`attnscale_mask`'s causal case:
    ``causal`` (with one query, every key).  Boolean: as it is.  Additive float (eager's, or a
    model's own): entries at or below :data:`~attnscale.pipeline.MASKED_BIAS` mask a key, and
    finite values above it are a logit bias."""
    if attention_mask is None:
        return None, False, None
    if _CAUSAL_MASKS.get(id(attention_mask)) is attention_mask:
        return None, n_q > 1, None
    if attention_mask.dim() == 4 and attention_mask.shape[-1] > n_k:
        # a mask built for a longer cache: its first Nk keys, as eager (and HF's SDPA) slice it
        attention_mask = attention_mask[..., :n_k]
    if attention_mask.dtype == torch.bool:
        return attention_mask, False, None
    keep = attention_mask > MASKED_BIAS
    values = torch.where(keep, attention_mask, torch.zeros((), dtype=attention_mask.dtype))
    return keep, False, (values if bool(values.any()) else None)


def head_logit_peaks(query: Tensor, key: Tensor, attention_mask: Tensor | None,
                     scaling: float | None = None) -> Tensor:
    """Each query head's largest logit ``scaling · q kᵀ`` -- the logit W_Q and W_K make, before
    any cap and without any additive position bias (what QK-Clip bounds) -- over the keys an HF
    attention call with these arguments attends (the mask read as
    :func:`attnscale_attention_forward` reads it): float64 (H,), -inf for a head with no key."""
    mask, causal, _ = _masks(attention_mask, query.shape[2], key.shape[2])
    scale = inv_sqrt(query.shape[-1]) if scaling is None else scaling
    return head_peaks(query, key, scale, mask=mask, causal=causal)


def attnscale_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                attention_mask: Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, softcap: float | None = None,
                                **kwargs) -> tuple[Tensor, None]:
    """The ``"attnscale"`` entry of HF's AttentionInterface: HF's eager attention, on
    attnscale's pipeline.

    Args:
        module: the HF attention layer (its ``attnscale_mechanism``, if set, owns the temperature).
        query: (B, H, Nq, d) after RoPE; key: (B, Hk, Nk, d), value: (B, Hk, Nk, d_v),
            ``H % Hk == 0``.  Head counts and sizes are read from these tensors.
        attention_mask: from :func:`attnscale_mask` (boolean, or its causal view), eager's float
            mask (a model that builds its own), or None for every key, as eager reads it.
        scaling, softcap: the layer's own temperature (None: d^-1/2, no cap).
        kwargs: ``position_bias`` (T5) is added to the logits; ``s_aux`` (gpt-oss) are the
            layer's sink logits; others eager ignores (``is_causal``, ``sliding_window``...) are
            ignored here too: the mask says what they say.
    Returns:
        ``(output (B, Nq, H, d_v), None)``; attention weights are never materialised.
    """
    if kwargs.get(ROW_SINKS_KWARG) is not None:  # ignoring them would change the attention
        raise ConfigError(f"{type(module).__name__} passes per-query sink logits "
                          f"({ROW_SINKS_KWARG}=, one per query and head), which attnscale's "
                          "sink normaliser (one per head) does not hold.")
    if dropout and module.training:
        raise ConfigError("attention dropout > 0 in training is not supported by "
                          "attn_implementation='attnscale'; set the model's attention dropout "
                          "to 0 (config.attention_dropout, attention_probs_dropout_prob...).")
    n_heads, d_head = query.shape[1], query.shape[-1]
    mechanism = getattr(module, MECHANISM_ATTR, None)
    recorded = getattr(getattr(module, "config", None), MECHANISM_ATTR, None)
    if mechanism is None and recorded is not None:
        # Loaded by transformers' own from_pretrained: the config names a mechanism the layers
        # lack, and the native temperature would run under that name.
        raise ConfigError(f"config.{MECHANISM_ATTR} records {recorded.get('name')!r} but "
                          f"{type(module).__name__} has no mechanism: load the model with "
                          "attnscale.hf.from_pretrained, or call attnscale.hf.set_mechanism.")
    if mechanism is None:
        mechanism = _native(d_head, n_heads, inv_sqrt(d_head) if scaling is None else scaling,
                            softcap)
    elif getattr(mechanism, "name", None) == CLIP_QKV:
        # set_mechanism clamped the projections' outputs (ProjectionClamp): its scale remains
        mechanism = _native(d_head, n_heads, inv_sqrt(d_head), None)
    sinks = kwargs.get(SINK_KWARG)
    if sinks is not None:  # gpt-oss: keep the model's own learned sinks
        mechanism = WithSinks(mechanism, sinks)
    groups = n_heads // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)      # (B, H, Nk, d), O(N d) memory
        value = value.repeat_interleave(groups, dim=1)
    mask, causal, bias = _masks(attention_mask, query.shape[2], key.shape[2])
    position_bias = kwargs.get(POSITION_BIAS_KWARG)
    if position_bias is not None:  # T5: added to the logits before the mask, as eager does
        bias = position_bias if bias is None else position_bias + bias
    out = attention(query, key, value, mechanism, mask=mask, causal=causal, bias=bias)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the ``"attnscale"`` attention implementation (and its mask function) with HF.

    Idempotent.  After it, ``from_config(cfg, attn_implementation="attnscale")`` and
    ``from_pretrained(path, attn_implementation="attnscale")`` work.
    """
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"attnscale.hf needs transformers >= {MIN_TRANSFORMERS}, found "
                          f"{transformers.__version__}: pip install 'attnscale[hf]'")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attnscale_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attnscale_mask)


