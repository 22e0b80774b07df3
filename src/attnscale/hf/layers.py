"""Which modules of an HF model are attention layers, and swapping their temperature
(:func:`set_mechanism`)."""

from __future__ import annotations

from torch import nn

from attnscale.errors import ConfigError
from attnscale.families import (
    LayerFacts, bypassing_layers, facts, family_of, is_attention_layer,
)
from attnscale.hf.attention import (
    ATTN_IMPLEMENTATION, CLIP_QKV, MECHANISM_ATTR, clamp_projections, register,
    unclamp_projections,
)
from attnscale.mechanisms import MECHANISMS, build_mechanism, check_mechanism

def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every attention layer of ``model``: every module whose forward
    dispatches through HF's AttentionInterface (:func:`attnscale.families.is_attention_layer`),
    whatever its family."""
    return [(name, m) for name, m in model.named_modules() if is_attention_layer(m)]


def check_supported(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`attention_layers`, or a ConfigError naming the family when there are none."""
    layers = attention_layers(model)
    if not layers:
        raise unsupported(getattr(getattr(model, "config", None), "model_type",
                                  type(model).__name__))
    return layers


def unsupported(family: str, prefix: str = "") -> ConfigError:
    """The error for a model family whose attention does not go through transformers'
    AttentionInterface (``prefix`` before it: what was being done)."""
    return ConfigError(f"{prefix}model family {family!r} does not route attention through "
                       "transformers' AttentionInterface, so attnscale cannot run, observe or "
                       "swap its temperature.")


def swap_facts(layers: list[tuple[str, nn.Module]], name: str | None = None
               ) -> dict[str, LayerFacts]:
    """The facts of every layer a swap to mechanism ``name`` changes, or one ConfigError naming
    every layer it cannot change and why (a swap is whole or refused)."""
    out, refused = {}, {}
    for qualified, layer in layers:
        try:
            f = facts(layer)
        except ConfigError as err:
            refused[qualified] = str(err)
            continue
        why = f.refusal or (None if f.n_heads is not None else
                            f"attnscale cannot tell the heads of {f.layer} ({f.family}).")
        if why is None and name == CLIP_QKV:
            try:
                family_of(layer).layout.projections(layer, f.family)
            except ConfigError as err:
                why = str(err)
        if why is not None:
            refused[qualified] = why
        out[qualified] = f
    if refused:
        shown = "; ".join(f"{q}: {why.rstrip('.')}" for q, why in list(refused.items())[:3])
        more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
        raise ConfigError(f"set_mechanism cannot change {len(refused)} of {len(layers)} "
                          f"attention layers, so it changes none: {shown}{more}.")
    return out


def refuse_bypassing(model: nn.Module, what: str) -> None:
    """ConfigError naming the attention layers of ``model`` that form their softmax themselves
    (the family table's ``own_attention``): ``what`` would leave them at their native
    temperature."""
    own = bypassing_layers(model)
    if own:
        name, cls = own[0]
        raise ConfigError(f"{what}: {name} ({cls}, and {len(own) - 1} more like it) forms its "
                          "softmax itself, not through transformers' AttentionInterface, so it "
                          f"would keep its native temperature; {what} changes no layer.")


# Mechanisms HF's attention function cannot run, by what they are (their logit_bias or
# normaliser), and why.
_HF_REFUSALS = {
    "forget": "reads forget gates from the layer's input, which HF's attention function does not "
              "see; use attnscale.MultiHeadAttention or attnscale.lm for it.",
    "select": "subtracts what every earlier query selected, which a KV cache does not keep "
              "(decoding would drop it); use attnscale.MultiHeadAttention or attnscale.lm for it.",
    "differential": "learns λ vectors per layer that a pretrained model does not have; "
                    "transformers' DiffLlama family is differential attention itself.",
}


def check_swappable(name: str, **options) -> None:
    """ConfigError unless :func:`set_mechanism` can install ``name`` with options of these names.

    Checks the name and option names without building anything (the option values are checked
    when :func:`set_mechanism` builds each layer's mechanism, before it changes the model).
    """
    check_swappable_options(name, options, "name")


def check_swappable_options(name: str, options: dict, param: str) -> None:
    """:func:`check_swappable` for an options dict, with errors prefixed by ``param`` (where the
    name came from: a parameter, or a config.json entry)."""
    check_mechanism(name, options, param=param)  # unknown name or option: did-you-mean
    if MECHANISMS[name].gate:
        raise ConfigError(f"mechanism {name!r} gates the attention output with the layer's "
                          "input, which HF's attention function does not see; use "
                          "attnscale.MultiHeadAttention or attnscale.lm for it.")
    refusal = _HF_REFUSALS.get(MECHANISMS[name].logit_bias or MECHANISMS[name].normaliser)
    if refusal:
        raise ConfigError(f"mechanism {name!r} {refusal}")
    if not MECHANISMS[name].defined_at_init:
        raise ConfigError(f"mechanism {name!r} acts on the W_Q and W_K weights, not on the q and "
                          "k HF passes to the attention function; use "
                          "attnscale.MultiHeadAttention for it.")


def _require_attnscale(layer: nn.Module, args) -> None:
    """Forward pre-hook of a layer holding a mechanism: its attention must still run on
    ``"attnscale"``.  However the implementation was changed afterwards
    (``model.set_attn_implementation("sdpa")``, ``config._attn_implementation = ...``), another
    one would drop the mechanism silently while ``config.attnscale_mechanism`` still names it."""
    implementation = getattr(getattr(layer, "config", None), "_attn_implementation", None)
    if hasattr(layer, MECHANISM_ATTR) and implementation != ATTN_IMPLEMENTATION:
        name = getattr(getattr(layer, MECHANISM_ATTR), "name", "") or "a mechanism"
        raise ConfigError(f"{type(layer).__name__} holds mechanism {name!r}, which only "
                          f"attn_implementation={ATTN_IMPLEMENTATION!r} applies, but the model now "
                          f"runs {implementation!r}: set it back, or remove the mechanism first "
                          "with attnscale.hf.set_mechanism(model, None).")


def set_mechanism(model: nn.Module, name: str | None, **options) -> list[str]:
    """Make mechanism ``name`` own the temperature of every attention layer of ``model``.

    Each layer gets a fresh ``build_mechanism(name, d_head, n_heads, **options)``, with the
    layer's own head count and size (:func:`attnscale.families.facts`: read off its projections,
    so a layer with more heads than ``config.num_attention_heads`` gets its own), as its
    submodule ``attnscale_mechanism`` (in the dtype and device of the layer's weights), and the
    model is switched to ``attn_implementation="attnscale"``.  The swap is whole or refused:
    every attention layer changes, or a ConfigError names the layers that cannot (a family not
    in the table, or one whose heads attnscale cannot tell) and nothing changes.
    ``name=None`` removes the mechanisms and restores the native temperature.  Returns the
    qualified names of the layers changed.

    ``clip-qkv`` clamps where OLMo and DBRX do: the outputs of the q, k and v projections
    (forward hooks on the projections the family's layout names, removed with the mechanism),
    before any norm and RoPE, so its logits depend on relative positions only; the attention
    function then applies its d^-1/2 alone.  Families without separate q, k, v outputs
    (multi-head latent attention) refuse it.

    Only ``"attnscale"`` applies the mechanism: a forward pass after the implementation was
    changed (``model.set_attn_implementation("sdpa")``, ``config._attn_implementation = ...``)
    is a ConfigError, not a silent return to the native temperature.

    Raises:
        ConfigError: unknown name or option (with a did-you-mean), a mechanism that acts on
            W_Q/W_K (init-reparam, sigma-reparam), a model family outside the interface, or
            layers the swap cannot change (named).
    """
    layers = check_supported(model)
    mechanisms = {}
    if name is not None:
        check_swappable(name, **options)
        refuse_bypassing(model, "set_mechanism")
        table = swap_facts(layers, name)
        # Built before anything changes, so a bad option value leaves the model as it was.
        for qualified, layer in layers:
            f = table[qualified]
            weight = next((p for p in layer.parameters() if p.is_floating_point()), None)
            mechanism = build_mechanism(name, f.d_head, f.n_heads, **options)
            if weight is not None:
                mechanism = mechanism.to(device=weight.device, dtype=weight.dtype)
            mechanisms[qualified] = mechanism
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for qualified, layer in layers:
        if hasattr(layer, MECHANISM_ATTR):
            delattr(layer, MECHANISM_ATTR)
        unclamp_projections(layer)
        if name is not None:  # a submodule: trains and saves with the model
            setattr(layer, MECHANISM_ATTR, mechanisms[qualified])
            if name == CLIP_QKV:
                clamp_projections(layer, mechanisms[qualified].clip)
            if not any(hook is _require_attnscale for hook in layer._forward_pre_hooks.values()):
                layer.register_forward_pre_hook(_require_attnscale)
    if name is None:
        if hasattr(model.config, MECHANISM_ATTR):
            delattr(model.config, MECHANISM_ATTR)
    else:  # written to config.json by save_pretrained; read back by from_pretrained below
        setattr(model.config, MECHANISM_ATTR, {"name": name, "options": dict(options)})
    return [qualified for qualified, _ in layers]
