"""Who owns the attention temperature, per layer: read from the model's family facts
(:mod:`attnscale.families`, the one table of per-family facts) and checked against what the
attention calls actually applied.

Two sources, each for what it knows best:

* the family's facts of each attention layer (:func:`attnscale.families.facts`): the scaling
  rule, q/k normalisation (per head or over the full width) with its learned gains, soft-cap,
  sinks, sliding window, position bias, YaRN / DeepSeek mscale, Llama 4's temperature tuning;
* the calls themselves (:class:`~attnscale.inspect.measure.Call`): the softmax scale, cap and
  normaliser that the pipeline received, so the report states the value used, not only the rule.

A family missing from the table is still measured (its calls say its scale, cap and sinks); its
layers say that the rest is unknown.  From both, :func:`owners` gives one row per attention layer
and :func:`owner_sentence` one plain sentence naming the owner, with the registry mechanism(s),
each spelled as the what-if takes it (:func:`parse_whatif`): ``qk-rmsnorm(over=head)``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from attnscale import families
from attnscale.errors import ConfigError, did_you_mean
from attnscale.inspect.measure import Call

# Relative tolerance for naming a measured scale by a rule (float32 rounding of a config value).
SCALE_RTOL = 1e-4
# How the report words the q/k normalisation kinds of the family table (LayerFacts.qk_norm_over).
QK_NORM_WORDS = {"head": "per head", "model": "over the full width"}
# ... and the norms themselves (QKNorm.kind, attnscale.families.QK_NORM_KINDS).
QK_NORM_KIND_WORDS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm", "l2": "L2 norm"}


def layer_facts(module: nn.Module | None) -> tuple[families.LayerFacts | None, str | None]:
    """The family facts of one attention layer, or None and the reason they are unknown (a
    family missing from the table: its calls are still measured)."""
    if module is None or not families.is_attention_layer(module):
        return None, "not an attention layer of transformers' AttentionInterface"
    try:
        return families.facts(module), None
    except ConfigError as err:
        return None, str(err)


def scaling_equals(scale: float | None, d_head: int, facts: families.LayerFacts | None,
                   config) -> str:
    """What a measured softmax scale equals, in words: ``1/sqrt(d_head)``, ``1/d_head``,
    ``query_pre_attn_scalar^-1/2``, YaRN's ``mscale^2/sqrt(d_head)`` (DeepSeek's
    yarn_get_mscale, squared: once on q and once on k), ``1`` (no divisor), or its value."""
    if scale is None:
        return "varies per query (a length-dependent temperature)"

    def near(x: float) -> bool:
        return math.isclose(scale, x, rel_tol=SCALE_RTOL)

    mscale = None if facts is None else facts.mscale
    pre = getattr(config, "query_pre_attn_scalar", None)
    if mscale and not near(1 / math.sqrt(d_head)) and near(mscale ** 2 / math.sqrt(d_head)):
        return f"mscale^2/sqrt(d_head) = {mscale:.4g}^2/sqrt({d_head})"
    if near(1 / math.sqrt(d_head)):
        return f"1/sqrt(d_head) = 1/sqrt({d_head})"
    if isinstance(pre, (int, float)) and pre > 0 and near(pre ** -0.5):
        return f"query_pre_attn_scalar^-1/2 = {pre:g}^-1/2"
    if near(1 / d_head):
        return f"1/d_head = 1/{d_head}"
    if near(1.0):
        return "1 (no divisor: the 1/sqrt(d) lives in the initialisation of W_Q)"
    return f"{scale:.6g} (neither 1/sqrt(d_head) = {1 / math.sqrt(d_head):.6g} nor 1/d_head)"


def _gain(module: nn.Module | None, facts: families.LayerFacts, side: str) -> dict | None:
    """min / median / max of a q or k norm's effective per-channel gain (``w``, or Gemma's
    ``1 + w``); None without a learned gain."""
    norm = facts.qk_norm
    if norm is None or norm.gain is None or module is None:
        return None
    weight = getattr(getattr(module, getattr(norm, side), None), "weight", None)
    if weight is None:
        return None
    w = weight.detach().double().flatten() + (1.0 if norm.gain == "1+w" else 0.0)
    return {"min": float(w.min()), "median": float(w.median()), "max": float(w.max())}


def whatif_choices() -> tuple[str, ...]:
    """The registry mechanisms a what-if can swap in (those :func:`attnscale.hf.set_mechanism`
    installs), in registry order."""
    from attnscale.hf.layers import check_swappable
    from attnscale.mechanisms import MECHANISMS

    out = []
    for name in MECHANISMS:
        try:
            check_swappable(name)
        except ConfigError:
            continue
        out.append(name)
    return tuple(out)


def parse_whatif(spec: str, param: str = "whatif") -> tuple[str, dict]:
    """A what-if mechanism as the report spells it, ``NAME`` or ``NAME(KEY=VALUE, ...)``
    (``qk-rmsnorm(over=head)``; the sweep grid's variant text,
    :func:`attnscale.experiments.lm.study.parse_variant`), as ``(name, options)``.

    Raises:
        ConfigError: one line naming ``param``: an unknown name (with the choices a what-if can
            run), one set_mechanism refuses (and why), an unknown option or a bad value (the
            mechanism is built once to check them), all before any model is loaded.
    """
    from attnscale.mechanisms import parse_variant
    from attnscale.mechanisms import MECHANISMS, build_mechanism

    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{param} must name a mechanism, NAME or NAME(KEY=VALUE, ...), got "
                          f"{spec!r}.")
    try:
        from attnscale.hf.layers import check_swappable_options
    except ImportError:
        raise ConfigError(f"{param}: a what-if swaps the mechanism in with attnscale.hf, which "
                          "needs transformers: pip install 'attnscale[hf]'") from None

    name = spec.partition("(")[0].strip()
    choices = whatif_choices()
    if name not in choices:
        if name in MECHANISMS:  # registered, but set_mechanism cannot install it: why
            try:
                check_swappable_options(name, {}, param)
            except ConfigError as err:
                raise ConfigError(_named(param, err)) from None
        raise ConfigError(f"{param}: Unknown mechanism {name!r}.{did_you_mean(name, choices)} "
                          f"Choices: {', '.join(choices)}.")
    name, options = parse_variant(spec, param=param)
    try:  # option values are checked where the mechanism is built: once here, up front
        build_mechanism(name, 64, 1, **options)
    except ConfigError as err:
        raise ConfigError(_named(param, err)) from None
    return name, options


def whatif_text(name: str, options: Mapping | None = None) -> str:
    """``name`` or ``name(key=value, ...)``, the one spelling of a mechanism with its options
    (:func:`attnscale.experiments.lm.study.variant_text`), which :func:`parse_whatif` reads."""
    from attnscale.mechanisms import variant_text
    return variant_text(name, dict(options or {}))


def option_defaults(name: str) -> dict:
    """The options of registry mechanism ``name`` with their defaults (``{"factor": 1.0,
    "mscale_all_dim": None}`` for yarn)."""
    from attnscale.mechanisms import MECHANISMS, mechanism_options

    params = inspect.signature(MECHANISMS[name].__init__).parameters
    return {key: params[key].default for key in mechanism_options(name)}


def whatif_identity(spec: str, d_head: int, n_heads: int, n_keys: int) -> bool:
    """Whether the what-if mechanism ``spec`` gives every query that attends 1 to ``n_keys``
    keys the plain softmax scale d^-1/2 (``scaled``'s temperature) and leaves q, k and v alone,
    so that at this length it changes nothing a 1/sqrt(d) model does: a scale-only rule (no cap,
    offset, bias, sink or other normaliser) on untouched q and k (``bilinear``) whose scale, read
    off the mechanism built as the what-if builds it (seed 0), is d^-1/2 at every key count.
    yarn and mscale at factor 1, logn and llama4-temp below their training length and
    learned-temp at its initialisation are; :func:`parse_whatif` spells ``spec``."""
    from attnscale.mechanisms import parse_variant
    from attnscale.mechanisms import build_mechanism

    name, options = parse_variant(spec, param="whatif")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mech = build_mechanism(name, d_head, n_heads, **options)
    if not (mech.bilinear and mech.scale_only and not mech.acts_on_values):
        return False
    counts = torch.arange(1, n_keys + 1, dtype=torch.float64).view(1, 1, -1, 1)
    q = torch.zeros(1, n_heads, n_keys, d_head, dtype=torch.float64)
    with torch.no_grad():
        scale = torch.as_tensor(mech.prepare(q, q, counts)[2], dtype=torch.float64)
    # float32 rounding of a scale computed as d^-1/2 (learned-temp's exp(-ln(d) / 2))
    return bool(torch.allclose(scale, torch.full_like(scale, d_head ** -0.5), rtol=SCALE_RTOL,
                               atol=0.0))


def _named(param: str, err: Exception) -> str:
    """An error's message, prefixed by ``param`` unless it already starts with it."""
    text = str(err)
    return text if text.startswith(param) else f"{param}: {text}"


def _deepseek_mscale(facts: families.LayerFacts, config) -> str:
    """``mscale(factor=F, mscale_all_dim=A)``, the registry's DeepSeek softmax scale, with the
    YaRN options of the config's rope parameters where they give the layer's mscale, else
    ``mscale``."""
    from attnscale.mechanisms.mscale import deepseek_mscale

    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, Mapping):
        factor, dim = rope.get("factor"), rope.get("mscale_all_dim")
        if isinstance(factor, (int, float)) and isinstance(dim, (int, float)) and \
                math.isclose(deepseek_mscale(float(factor), float(dim)), facts.mscale ** 2,
                             rel_tol=SCALE_RTOL):
            return whatif_text("mscale", {"factor": float(factor), "mscale_all_dim": float(dim)})
    return "mscale"


def mechanisms_of(call: Call, facts: families.LayerFacts | None, equals: str,
                  config=None) -> list[str]:
    """The registry mechanisms a layer's temperature corresponds to, spelled as
    :func:`parse_whatif` reads them."""
    if call.mechanism != "native":
        return [call.mechanism]
    out = []
    if facts is not None and facts.normaliser == "differential":
        out.append("differential")  # DiffLlama: head pairs, p1 − λ p2
    elif facts is not None and facts.qk_norm is not None:
        out.append(whatif_text(*facts.qk_norm.mechanism))
    elif equals.startswith("1/d_head"):
        out.append("mup")
    elif equals.startswith("1 ("):
        out.append("init-reparam")
    elif equals.startswith("mscale"):
        out.append(_deepseek_mscale(facts, config))
    else:
        out.append("scaled")
    if facts is not None and facts.temperature_tuning is not None:
        out.append("llama4-temp")
    if call.cap is not None:
        out.append("softcap")
    if call.sinks:
        out.append("sink")
    return out


def applied_window(window: int | None, keys: int | None, total: int | None) -> int | None:
    """The sliding window a layer applied: the facts' ``window``; where they name none but the
    mask kept every query to fewer keys than it was handed (the most keys a query attended,
    ``keys``, below ``total``), those keys, as measured (a window the table does not know of).
    A window as long as the input changes nothing, and a bidirectional one spans up to twice
    its width, so the keys attended confirm a window without giving its width."""
    if window is None and keys is not None and total is not None and keys < total:
        return keys
    return window


def unmeasured_layers(model: nn.Module, layers: Sequence[Mapping]) -> list[str]:
    """The attention layers of ``model`` (transformers' AttentionInterface) that no measured
    call reached: a tower the input does not run (Qwen2-VL's vision layers on token ids)."""
    seen = {row["module"].split("#")[0] for row in layers}
    return [name for name, m in model.named_modules()
            if families.is_attention_layer(m) and name not in seen]


def owners(model: nn.Module, calls: Mapping[str, Call], records: Sequence[Mapping]) -> list[dict]:
    """One row per attention layer (in record order): the measured scale and what it equals, the
    family's facts, q/k gains with their measured effect (median q_rms · k_rms over the layer's
    heads: what the gains make of unit-rms normalised q and k), the registry mechanisms and who
    owns the temperature.  Where a fact shows in the calls, the calls decide: the sliding window
    (:func:`applied_window`, from the keys each query attended) and the position bias (the
    family's, where the call carried a bias: T5's cross-attention has none)."""
    modules = dict(model.named_modules())
    by_layer: dict[int, list[Mapping]] = {}
    for r in records:
        by_layer.setdefault(r["layer"], []).append(r)
    out = []
    for layer, heads in sorted(by_layer.items()):
        site = heads[0]["module"]
        module = modules.get(site.split("#")[0])
        facts, unknown = layer_facts(module)
        call = calls.get(site)
        d = heads[0].get("d_head") or 0
        scale = None if call is None else call.scale
        equals = (scaling_equals(scale, d, facts, getattr(module, "config", None))
                  if call is not None and d else "not observed")
        effect = sorted(h["q_rms"] * h["k_rms"] for h in heads
                        if math.isfinite(h.get("q_rms", math.nan)))
        tuning = None if facts is None else facts.temperature_tuning
        bias = None if facts is None else facts.position_bias
        if call is not None and not call.bias:
            bias = None  # the family's bias, where this layer's calls carry none
        elif call is not None and bias is None:
            bias = "additive (as measured)"
        norm = None if facts is None else facts.qk_norm
        row = {"layer": layer, "module": site, "d_head": d,
               "family": None if facts is None else facts.family,
               "mechanism": None if call is None else call.mechanism,
               "scale": scale, "mean_scale": None if call is None else call.mean_scale,
               "scaling": equals,
               "scaling_rule": None if facts is None else facts.scaling_rule,
               "softcap": None if call is None else call.cap,
               "sinks": bool(call is not None and call.sinks),
               "qk_norm": None if norm is None else facts.qk_norm_over,
               "qk_norm_kind": None if norm is None else norm.kind,
               "qk_norm_gain": None if norm is None else norm.gain,
               "q_gain": None if facts is None else _gain(module, facts, "q"),
               "k_gain": None if facts is None else _gain(module, facts, "k"),
               "qk_scale_median": effect[len(effect) // 2] if effect else None,
               "sliding_window": applied_window(None if facts is None else facts.sliding_window,
                                                heads[0].get("n_keys"), heads[0].get("key_len")),
               "position_bias": bias,
               "normaliser": "softmax" if facts is None else facts.normaliser,
               "mscale": None if facts is None else facts.mscale,
               "temperature_tuning": None if tuning is None else
               {"floor_scale": tuning.floor_scale, "attn_scale": tuning.attn_scale},
               "facts_unknown": unknown,
               "mechanisms": [] if call is None else
               mechanisms_of(call, facts, equals, getattr(module, "config", None))}
        row["owner"] = layer_owner(row)
        out.append(row)
    return out


def layer_owner(row: Mapping) -> str:
    """Who owns one layer's temperature, as a phrase."""
    if row["mechanism"] not in (None, "native"):
        return f"the swapped-in mechanism {row['mechanism']!r}"
    parts = []
    if row["qk_norm"]:
        over = QK_NORM_WORDS.get(row["qk_norm"], row["qk_norm"])
        kind = QK_NORM_KIND_WORDS.get(row.get("qk_norm_kind"), "norm")
        gains = ("and its learned gains" if row.get("qk_norm_gain", "w") else
                 f"(an {kind} without a gain, so nothing learned; then scale {row['scaling']})")
        parts.append(f"the q/k normalisation {over} {gains}" if "then scale" in gains else
                     f"the q/k normalisation {over} {gains} (then scale {row['scaling']})")
    elif row["scaling"].startswith("1 ("):
        parts.append("the initialisation of W_Q (the scale is 1: no divisor)")
    else:
        parts.append(f"the divisor (scale {row['scaling']})")
    if row["temperature_tuning"]:
        parts.append("Llama 4's length-dependent temperature tuning")
    if row["softcap"]:
        parts.append(f"a soft-cap at {row['softcap']:g}")
    if row["sinks"]:
        parts.append("learned attention sinks")
    if row.get("normaliser") == "differential":
        parts.append("differential attention's learned λ (each head pair's output is the first "
                     "map's less λ times the second's)")
    if row["position_bias"]:
        parts.append(f"an additive {row['position_bias']} position bias")
    phrase = _and(parts)
    if row.get("facts_unknown"):
        phrase += " (as measured; the family's q/k norms and biases are unknown to attnscale)"
    return phrase


def _and(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def owner_sentence(layers: Sequence[Mapping], model_type: str,
                   unmeasured: Sequence[str] = ()) -> str:
    """One plain sentence naming the owner of the temperature (per group of layers where they
    differ), with the registry mechanism(s), and which attention layers that covers: those the
    input reached, the others (``unmeasured``, :func:`unmeasured_layers`) named as not
    measured."""
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for row in layers:
        groups.setdefault((row["owner"], tuple(row["mechanisms"])), []).append(row["layer"])
    if not groups:
        return f"No attention call of this {model_type} model was observed."
    phrases = []
    for (owner, mechs), idx in groups.items():
        if len(groups) == 1 and not unmeasured:
            which = "in every layer"
        elif len(groups) == 1:
            which = f"in all {len(idx)} attention layers this input ran"
        else:
            which = f"in layer{'s' if len(idx) > 1 else ''} {_ranges(idx)}"
        names = ", ".join(f"`{m}`" for m in mechs)
        phrases.append(f"{owner} {which} (attnscale: {names})")
    sentence = (f"The attention temperature of this {model_type} model is owned by "
                + "; and by ".join(phrases) + ".")
    if unmeasured:
        shown = ", ".join(unmeasured[:2]) + (", ..." if len(unmeasured) > 2 else "")
        sentence += (f" {len(unmeasured)} other attention layer"
                     f"{'s' if len(unmeasured) > 1 else ''} of the model ({shown}) "
                     f"{'were' if len(unmeasured) > 1 else 'was'} not run by this input and "
                     "not measured.")
    return sentence


def _ranges(idx: Sequence[int]) -> str:
    """0,1,2,5 -> '0-2, 5'."""
    out, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
