"""Who owns the attention temperature, per layer: read from the model (its per-family facts and its
modules) and checked against what the attention calls actually applied.

Two sources, each for what it knows best:

* the per-layer facts of the model's family (:func:`layer_facts`): the scaling rule, q/k
  normalisation (per head or over the full width), soft-cap, sinks, sliding window, position
  bias, YaRN / DeepSeek mscale, Llama 4's temperature tuning;
* the calls themselves (:class:`~attnscale.inspect.measure.Call`): the softmax scale, cap and
  normaliser that the pipeline received, so the report states the value used, not the one the
  config promises.

From them, :func:`owners` gives one row per attention layer and :func:`owner_sentence` one plain
sentence naming the owner, with the registry mechanism(s) it corresponds to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from torch import nn

from attnscale.inspect.measure import Call

# Relative tolerance for naming a measured scale by a rule (float32 rounding of a config value).
SCALE_RTOL = 1e-4


@dataclass(frozen=True)
class LayerFacts:
    """What the model's family says about one attention layer's temperature."""
    qk_norm: str | None = None          # None, "head" (per head) or "full" (over the full width)
    q_norm: nn.Module | None = None     # the norm modules, for their learned gains
    k_norm: nn.Module | None = None
    softcap: float | None = None        # tanh soft-cap on the logits
    sinks: bool = False                 # learned per-head attention sinks
    sliding_window: int | None = None   # keys within this distance only
    position_bias: str | None = None    # "alibi", "relative" (T5) or None
    mscale: float | None = None         # YaRN / DeepSeek factor on the softmax scale
    temperature_tuning: Mapping | None = None   # Llama 4: {"floor_scale", "attn_scale"}
    query_pre_attn_scalar: float | None = None  # Gemma: the scale is this ** -0.5


def layer_facts(model: nn.Module, module: nn.Module) -> LayerFacts:
    """The family facts of one attention layer ``module`` of ``model``.

    Adapter: until attnscale.hf holds the table of per-family facts, this reads the few config
    attributes and submodules that carry them in transformers (``q_norm``/``k_norm``,
    ``attn_logit_softcapping``, ``sliding_window``, ``rope_scaling``, ``attn_temperature_tuning``,
    ``query_pre_attn_scalar``, the ``sinks`` parameter).  Everything the report says about who
    owns the temperature goes through this one function.
    """
    config = getattr(model, "config", None)
    get = (lambda name: getattr(config, name, None)) if config is not None else (lambda _: None)
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    qk = None
    if isinstance(q_norm, nn.Module) and isinstance(k_norm, nn.Module):
        width = getattr(getattr(q_norm, "weight", None), "numel", lambda: 0)()
        head_dim = getattr(module, "head_dim", None)
        qk = "head" if head_dim and width == head_dim else "full"
    rope = get("rope_scaling") or {}
    mscale = None
    if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type")) in ("yarn",):
        factor = float(rope.get("factor") or 1.0)
        m_all = rope.get("mscale_all_dim")
        mscale = (0.1 * float(m_all) * math.log(factor) + 1) ** 2 if m_all else None
    tuning = None
    if get("attn_temperature_tuning"):
        tuning = {"floor_scale": get("floor_scale"), "attn_scale": get("attn_scale")}
    window = getattr(module, "sliding_window", None)
    return LayerFacts(
        qk_norm=qk, q_norm=q_norm if qk else None, k_norm=k_norm if qk else None,
        softcap=get("attn_logit_softcapping"), sinks=hasattr(module, "sinks"),
        sliding_window=window if isinstance(window, int) else None,
        position_bias="relative" if hasattr(module, "relative_attention_bias")
        or get("relative_attention_num_buckets") else ("alibi" if get("alibi") else None),
        mscale=mscale, temperature_tuning=tuning,
        query_pre_attn_scalar=get("query_pre_attn_scalar"))


def scaling_rule(scale: float | None, d_head: int, facts: LayerFacts) -> str:
    """What a measured softmax scale equals, in words: ``1/sqrt(d_head)``, ``1/d_head``,
    ``query_pre_attn_scalar^-1/2``, ``1`` (no divisor), or its value."""
    if scale is None:
        return "varies per query (a length-dependent temperature)"

    def near(x: float) -> bool:
        return math.isclose(scale, x, rel_tol=SCALE_RTOL)

    if facts.mscale and near(facts.mscale / math.sqrt(d_head)):
        return f"mscale/sqrt(d_head) = {facts.mscale:.4g}/sqrt({d_head})"
    if near(1 / math.sqrt(d_head)):
        return f"1/sqrt(d_head) = 1/sqrt({d_head})"
    if facts.query_pre_attn_scalar and near(facts.query_pre_attn_scalar ** -0.5):
        return f"query_pre_attn_scalar^-1/2 = {facts.query_pre_attn_scalar:g}^-1/2"
    if near(1 / d_head):
        return f"1/d_head = 1/{d_head}"
    if near(1.0):
        return "1 (no divisor: any 1/sqrt(d) lives in the initialisation of W_Q)"
    return f"{scale:.6g} (neither 1/sqrt(d_head) = {1 / math.sqrt(d_head):.6g} nor 1/d_head)"


def _gain_spread(norm: nn.Module | None) -> dict | None:
    weight = getattr(norm, "weight", None)
    if weight is None:
        return None
    w = weight.detach().double().flatten()
    return {"min": float(w.min()), "median": float(w.median()), "max": float(w.max())}


def mechanisms_of(call: Call, facts: LayerFacts, rule: str) -> list[str]:
    """The registry mechanisms the layer's temperature corresponds to."""
    if call.mechanism != "native":
        return [call.mechanism]
    out = []
    if facts.qk_norm:
        out.append("qk-rmsnorm" if facts.qk_norm == "head" else "qk-layernorm(over=model)")
    elif rule.startswith("1/d_head"):
        out.append("mup")
    elif rule.startswith("1 ("):
        out.append("init-reparam")
    elif rule.startswith("mscale"):
        out.append("yarn")
    else:
        out.append("scaled")
    if facts.temperature_tuning:
        out.append("llama4-temp")
    if call.cap is not None or facts.softcap:
        out.append("softcap")
    if call.sinks or facts.sinks:
        out.append("sink")
    return out


def owners(model: nn.Module, calls: Mapping[str, Call], records: Sequence[Mapping]) -> list[dict]:
    """One row per attention layer (in record order): the measured scale and what it equals, the
    family facts, q/k gains with their measured effect (median q_rms · k_rms over the layer's
    heads), the registry mechanisms and who owns the temperature."""
    modules = dict(model.named_modules())
    by_layer: dict[int, list[Mapping]] = {}
    for r in records:
        by_layer.setdefault(r["layer"], []).append(r)
    out = []
    for layer, heads in sorted(by_layer.items()):
        site = heads[0]["module"]
        module = modules.get(site.split("#")[0])
        facts = layer_facts(model, module) if module is not None else LayerFacts()
        call = calls.get(site)
        d = heads[0].get("d_head") or 0
        scale = None if call is None else call.scale
        rule = scaling_rule(scale, d, facts) if call is not None and d else "not observed"
        effect = sorted(h["q_rms"] * h["k_rms"] for h in heads
                        if math.isfinite(h.get("q_rms", math.nan)))
        row = {"layer": layer, "module": site, "d_head": d,
               "mechanism": None if call is None else call.mechanism,
               "scale": scale, "mean_scale": None if call is None else call.mean_scale,
               "scaling": rule, "softcap": (call.cap if call is not None else None)
               or facts.softcap, "sinks": bool(call is not None and call.sinks) or facts.sinks,
               "qk_norm": facts.qk_norm, "q_gain": _gain_spread(facts.q_norm),
               "k_gain": _gain_spread(facts.k_norm),
               "qk_scale_median": effect[len(effect) // 2] if effect else None,
               "sliding_window": facts.sliding_window, "position_bias": facts.position_bias,
               "mscale": facts.mscale, "temperature_tuning": facts.temperature_tuning,
               "mechanisms": [] if call is None else mechanisms_of(call, facts, rule)}
        row["owner"] = layer_owner(row)
        out.append(row)
    return out


def layer_owner(row: Mapping) -> str:
    """Who owns one layer's temperature, as a phrase."""
    if row["mechanism"] not in (None, "native"):
        return f"the swapped-in mechanism {row['mechanism']!r}"
    parts = []
    if row["qk_norm"]:
        where = "per head" if row["qk_norm"] == "head" else "over the full width"
        parts.append(f"the q/k normalisation {where} and its learned gains (then scale "
                     f"{row['scaling']})")
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
    if row["position_bias"]:
        parts.append(f"an additive {row['position_bias']} position bias")
    return _and(parts)


def _and(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def owner_sentence(layers: Sequence[Mapping], model_type: str) -> str:
    """One plain sentence naming the owner of the temperature (per group of layers where they
    differ), with the registry mechanism(s)."""
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for row in layers:
        groups.setdefault((row["owner"], tuple(row["mechanisms"])), []).append(row["layer"])
    if not groups:
        return f"No attention call of this {model_type} model was observed."
    phrases = []
    for (owner, mechs), idx in groups.items():
        which = "in every layer" if len(groups) == 1 else f"in layers {_ranges(idx)}"
        names = ", ".join(f"`{m}`" for m in mechs)
        phrases.append(f"{owner} {which} (attnscale: {names})")
    return (f"The attention temperature of this {model_type} model is owned by "
            + "; and by ".join(phrases) + ".")


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


def facts_record(facts: LayerFacts) -> dict:
    """``facts`` without its modules, for JSON."""
    return {k: v for k, v in asdict(facts).items() if k not in ("q_norm", "k_norm")}
