"""The facts of one attention layer, read from the family table and the layer itself:
:func:`facts` and the :class:`LayerFacts` it returns."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from torch import Tensor, nn

from attnscale.errors import ConfigError
from attnscale.families.layouts import Heads
from attnscale.families.table import FAMILIES, OWN_ATTENTION, Family, QKNorm

# The name a layer's forward must look up to dispatch through transformers' AttentionInterface
# (modeling_utils.ALL_ATTENTION_FUNCTIONS): what makes a module an attention layer here.
INTERFACE_NAME = "ALL_ATTENTION_FUNCTIONS"


def is_attention_layer(module: nn.Module) -> bool:
    """Whether ``module.forward`` dispatches through HF's AttentionInterface: what the layer
    does, read from its code (the names its forward looks up), not from attribute names."""
    forward = inspect.unwrap(type(module).forward)  # past HF's deprecation decorators
    code = getattr(forward, "__code__", None)
    return code is not None and INTERFACE_NAME in code.co_names


def bypassing_layers(model: nn.Module) -> list[tuple[str, str]]:
    """``(qualified name, class name)`` of every module of ``model`` whose class the table lists
    as attention that forms its softmax itself (``Family.own_attention``)."""
    return [(name, type(m).__name__) for name, m in model.named_modules()
            if type(m).__name__ in OWN_ATTENTION]


def family_name(layer: nn.Module) -> str:
    """The family of an attention layer: the ``model_type`` of the config it holds."""
    return str(getattr(getattr(layer, "config", None), "model_type", "") or "")


def family_of(layer: nn.Module) -> Family:
    """The table row of an attention layer (its class's row where the family has several).

    Raises:
        ConfigError: the family is not in the table, naming it and the layer's class.
    """
    name = family_name(layer)
    row = FAMILIES.get(name)
    if row is None:
        raise ConfigError(f"{type(layer).__name__} belongs to model type {name or '(none)'!r}, "
                          "which is not in attnscale's family table (attnscale.families."
                          "FAMILIES), so its heads and projections are unknown.")
    return row.by_class.get(type(layer).__name__, row)


@dataclass(frozen=True)
class TemperatureTuning:
    """Llama 4's attention-temperature tuning (Llama 4 release; HF modeling_llama4.py), on its
    layers without RoPE: q ← q · (1 + attn_scale · ln(1 + ⌊(i + 1) / floor_scale⌋)) at
    position i, applied before the attention function."""
    floor_scale: float
    attn_scale: float


@dataclass(frozen=True)
class LayerFacts:
    """What sets one attention layer's temperature, and where its W_Q and W_K are.

    Head counts and sizes are those the layer will hand its attention function, read before any
    forward from the projections the family's layout names (None where the family has no layout;
    ``refusal`` then says why).
    """
    family: str                 # the model_type of the layer's config
    layer: str                  # its class name
    layout: str | None          # projection layout (attnscale.families.layouts), or None
    n_heads: int | None         # H query heads
    n_kv_heads: int | None      # Hk key/value heads (grouped-query attention when < H)
    d_head: int | None          # d of each q and k head
    d_value: int | None         # d_v of each v head
    scaling: float | None       # the softmax scale the layer passes (its ``scaling``), or None
    scaling_rule: str           # where that scale comes from ("d^-1/2", Gemma's, T5's 1...)
    mscale: float | None        # YaRN's mscale, scaling = mscale² / √d (MLA rows; 1 without YaRN)
    softcap: float | None       # logit soft-cap c in c · tanh(z / c) the layer passes
    sinks: bool                 # learned per-head sink logits (gpt-oss)
    sliding_window: int | None  # keys each query sees back, where the layer is windowed
    position_bias: str | None   # "t5-relative", "alibi" or None: an additive logit bias
    qk_norm_over: str           # "none", "head" (per head, over d) or "model" (over H · d)
    qk_norm: QKNorm | None      # the norm's kind, gain and attributes, or None
    temperature_tuning: TemperatureTuning | None  # Llama 4, on its NoPE layers
    mask: str                   # "boolean", or "additive" (the model edits eager's float mask)
    calls: int                  # attention calls per forward
    normaliser: str             # "softmax", or "differential" (DiffLlama's head pairs)
    refusal: str | None         # why set_mechanism and QK-Clip cannot serve it, or None
    clip_refusal: str | None    # why QK-Clip cannot (set_mechanism can), or None

    @property
    def heads(self) -> Heads | None:
        if self.n_heads is None:
            return None
        return Heads(self.n_heads, self.n_kv_heads, self.d_head, self.d_value)


def facts(layer_or_model: nn.Module) -> LayerFacts | dict[str, LayerFacts]:
    """The :class:`LayerFacts` of an attention layer, or, for any other module (a model), a
    dict ``{qualified name: LayerFacts}`` of every attention layer in it, in module order.

    Raises:
        ConfigError: a layer whose family is not in the table (naming it), or whose module
            lacks an attribute its row names (a table error the family sweep catches).
    """
    if is_attention_layer(layer_or_model):
        return _layer_facts(layer_or_model)
    return {name: _layer_facts(m) for name, m in layer_or_model.named_modules()
            if is_attention_layer(m)}


def _config_window(layer: nn.Module, config) -> int | None:
    """The sliding window of a layer that keeps none itself: Mistral, Mixtral, Starcoder2 and
    Phi-3 read ``config.sliding_window`` where they build the mask (a windowed one for every
    layer when it is set) and pass it to the attention call.  None where the config turns it
    off (``use_sliding_window=False``) or its ``layer_types`` make this layer a full one."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        return None
    types, index = getattr(config, "layer_types", None), getattr(layer, "layer_idx", None)
    if isinstance(types, (list, tuple)) and isinstance(index, int) and index < len(types) \
            and types[index] != "sliding_attention":
        return None
    return window


def _layer_facts(layer: nn.Module) -> LayerFacts:
    row, family = family_of(layer), family_name(layer)
    config = getattr(layer, "config", None)
    heads = None if row.layout is None else row.layout.heads(layer, family)
    scaling = getattr(layer, row.scaling_attr, None) if row.scaling_attr else 1.0
    scaling = float(scaling) if isinstance(scaling, (int, float)) else None
    mscale = None
    if row.layout is not None and row.layout.name == "latent" and scaling is not None:
        mscale = math.sqrt(scaling * math.sqrt(heads.d_head)) if scaling > 0 else None
    softcap = getattr(config, row.softcap, None) if row.softcap else None
    window = None
    if row.window:
        window = getattr(layer, row.window) if hasattr(layer, row.window) else \
            _config_window(layer, config)
    norm = row.qk_norm
    if norm is not None and not isinstance(getattr(layer, norm.q, None), nn.Module):
        norm = None  # a layer of the family built without its norm (Llama 4's NoPE layers...)
    tuning = None
    if row.temperature_tuning and getattr(layer, "attn_temperature_tuning", False) \
            and not getattr(layer, "use_rope", True):
        tuning = TemperatureTuning(float(config.floor_scale), float(config.attn_scale))
    return LayerFacts(
        family=family, layer=type(layer).__name__,
        layout=None if row.layout is None else row.layout.name,
        n_heads=None if heads is None else heads.n_heads,
        n_kv_heads=None if heads is None else heads.n_kv_heads,
        d_head=None if heads is None else heads.d_head,
        d_value=None if heads is None else heads.d_value,
        scaling=scaling, scaling_rule=row.scaling, mscale=mscale,
        softcap=None if softcap is None else float(softcap),
        sinks=row.sinks is not None and isinstance(getattr(layer, row.sinks, None), Tensor),
        sliding_window=window if isinstance(window, int) and window > 0 else None,
        position_bias=row.position_bias,
        qk_norm_over="none" if norm is None else norm.over, qk_norm=norm,
        temperature_tuning=tuning, mask=row.mask, calls=row.calls, normaliser=row.normaliser,
        refusal=row.refusal if row.layout is not None else (
            row.refusal or f"attnscale cannot tell where {family}'s W_Q and W_K are."),
        clip_refusal=row.clip_refusal)
