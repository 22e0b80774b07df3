"""The records of ``attnscale inspect``: one flat row per (layer, head), every field documented
in :data:`FIELDS`, and the summary that the report's verdict states.

A row joins three forward passes on the same tokens: the checkpoint (no prefix), the same
architecture freshly initialised by its own ``_init_weights`` (``init_``) and, with a what-if
mechanism, the checkpoint with its temperature swapped (``whatif_``).  ``drift_`` is trained ÷ init.

:func:`check_store` checks the contents of a ``records.json`` read back (``--from``) against the
documented fields before anything is drawn from them, naming the first bad field.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence

from attnscale.columns import RECORD_STATS
from attnscale.errors import ConfigError, check_float, spelled

# A head is saturated when its mean max weight exceeds this: three quarters of the mass on one
# key, where the essay's unscaled attention sits at d_k = 64 (max weight 0.749 over 256 keys).
SATURATED_MAX_WEIGHT = 0.75
# ... or when its entropy falls below this fraction of ln n (n the keys attended): the fraction
# attnscale's guard uses for entropy collapse (Zhai et al. 2023, arXiv 2303.06296).
SATURATED_ENTROPY_FRACTION = 0.1
# The footnote's premise holds at initialisation when q's and k's components have an rms within
# this factor of 1 (so q·k/√d has a std within this factor squared of 1 for independent q and k);
# the divisor is calibrated when the logits' std is within this factor of 1.
PREMISE_FACTOR = 2.0

# The statistics compared between passes (trained, init, what-if), in the report's order.
COMPARED = ("logit_std", "entropy_ratio", "max_weight_mean", "jacobian_fro_mean", "coherence",
            "q_rms", "k_rms")
PASSES = {"init": "init_", "whatif": "whatif_"}

# What the monitor's record statistics (attnscale.columns.RECORD_STATS) mean; every one of them
# is a field of the report, so a statistic added there reaches it too.
MONITOR_MEANINGS = {
    "entropy_mean": "mean attention entropy H(p) over the rows, nats",
    "entropy_min": "smallest row entropy, nats",
    "max_weight_mean": "mean of max_i p_i over the rows",
    "logit_std": "mean over rows of the std of the logits entering the normaliser (0 for a row "
                 "with one key)",
    "logit_absmax": "largest |logit| over every row and attended key",
    "jacobian_fro_mean": "mean Frobenius norm of the softmax Jacobian diag(p) - p p^T: the "
                         "factor every gradient to W_Q and W_K passes through",
    "mass_mean": "mean weight on the keys, sum_i p_i (1 under softmax; less with a sink)",
    "sink_mass_mean": "mean weight left on the head's attention sink (0 without one)",
    "gate_mean": "mean output gate (1 without a gate)",
}
# Every field of a record, in order, with its meaning (written into records.json).
FIELDS: dict[str, str] = {
    "layer": "attention module, in the order of its first call in the forward pass (from 0)",
    "head": "query head (from 0)",
    "module": "qualified name of the attention module",
    "d_head": "head dimension d the statistics are measured at",
    "n_keys": "the most keys a query attends, as the mask says (the sequence length for "
              "self-attention, a sliding window's width on a windowed layer)",
    "queries": "(batch, query) rows with at least one key",
    **{key: MONITOR_MEANINGS.get(key, "the monitor's statistic of that name "
                                      "(attnscale.columns)") for key in RECORD_STATS},
    "mean_ln_keys": "mean over the rows of ln n, n the keys the row attends (and the head's "
                    "sink, where it has one: the entropy covers the sink too)",
    "entropy_ratio": "entropy_mean / mean_ln_keys: 1 for uniform attention, 0 for one-hot",
    "q_rms": "mean over rows of |q| / sqrt(d), the rms of one query component after the "
             "projection, any q/k norm and RoPE (1 under the footnote's premise)",
    "k_rms": "mean over rows of the rms of |k_i| / sqrt(d) over the keys the row attends",
    "coherence": "mean over rows (two keys or more) of std_i(q.k_i) / (|q| rms_i|k_i| / "
                 "sqrt(d)): about 1 for independent q and k, up to sqrt(d) when aligned",
    "coherent_rows": "rows the coherence is averaged over (two keys or more and a nonzero "
                     "query: a padding token's zero query has none)",
    "sqrt_d": "sqrt(d_head), the coherence of fully aligned q and k",
    "saturated": f"mean max weight > the threshold (default {SATURATED_MAX_WEIGHT}) or "
                 f"entropy_ratio < the threshold (default {SATURATED_ENTROPY_FRACTION}); for a "
                 "head with a sink the weight is a key's, and low entropy counts where a key "
                 "outweighs the sink (a head resting on its sink is not saturated)",
    **{f"init_{s}": f"{s} of the same architecture freshly initialised by its own "
                    "_init_weights (fixed seed), on the same tokens" for s in COMPARED},
    **{f"drift_{s}": f"{s} / init_{s}: how far training moved it" for s in COMPARED},
    **{f"whatif_{s}": f"{s} with the what-if mechanism in place of the model's temperature "
                      "(null without one)" for s in COMPARED},
    "whatif_saturated": "saturated, under the what-if mechanism (null without one)",
}


# The kind of each field of a record whose values are not numbers (a number is a float or an int,
# null for NaN): see check_store.
FIELD_KINDS = {"layer": "index", "head": "index", "module": "text", "d_head": "size?",
               "n_keys": "index?", "queries": "index", "coherent_rows": "index",
               "saturated": "flag", "whatif_saturated": "flag?"}
# The fields of the report's meta that it reads, and their kinds.
META_KINDS = {"name": "text", "model_type": "text", "seq_len": "size", "input": "text",
              "dtype": "text", "device": "text", "seed": "index", "init": "flag",
              "whatif": "text?", "attnscale": "text"}
# The fields of each owner row (the report's "layers") that it reads, and their kinds.
LAYER_KINDS = {"layer": "index", "scale": "number", "scaling": "text", "scaling_rule": "text?",
               "qk_norm": "text?", "q_gain": "gain?", "k_gain": "gain?",
               "qk_scale_median": "number", "softcap": "number", "sinks": "flag",
               "sliding_window": "size?", "position_bias": "text?", "mechanisms": "texts",
               "owner": "text"}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# What each kind admits, and how an error says it.
_KINDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "number": (lambda x: x is None or _is_number(x), "a finite number or null"),
    "index": (lambda x: _is_int(x) and x >= 0, "an integer >= 0"),
    "size": (lambda x: _is_int(x) and x >= 1, "an integer >= 1"),
    "text": (lambda x: isinstance(x, str), "a string"),
    "flag": (lambda x: isinstance(x, bool), "true or false"),
    "texts": (lambda x: isinstance(x, list) and all(isinstance(v, str) for v in x),
              "a list of strings"),
    "gain": (lambda x: isinstance(x, dict) and all(k in x and _KINDS["number"][0](x[k])
                                                   for k in ("min", "median", "max")),
             "an object of numbers min, median and max"),
}


def _check_kinds(obj, kinds: Mapping[str, str], where: str, bad: Callable[[str], ConfigError],
                 ) -> None:
    """Every key of ``kinds`` in the object ``obj`` (at ``where``), of its kind (a kind ending
    in ``?`` also admits null)."""
    if not isinstance(obj, dict):
        raise bad(f"{where} must be an object, got {type(obj).__name__}")
    for key, kind in kinds.items():
        if key not in obj:
            raise bad(f"{where} lacks {key!r}")
        value, optional = obj[key], kind.endswith("?")
        admits, words = _KINDS[kind.rstrip("?")]
        if not ((optional and value is None) or admits(value)):
            raise bad(f"{where}.{key} must be {words}{' or null' if optional else ''}, got "
                      f"{json_text(value)}")


def json_text(value) -> str:
    """A value as records.json spells it, cut to 40 characters."""
    import json
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_store(payload, where: str) -> dict:
    """The contents of a report's ``records.json`` (``where`` names it in errors), checked field
    by field before anything is drawn from them: the records (every field of :data:`FIELDS`, of
    its kind: :data:`FIELD_KINDS`, else a finite number or null), the meta and owner rows the
    report reads (:data:`META_KINDS`, :data:`LAYER_KINDS`) and the saturation thresholds.
    Indices are bounded by the records: layers 0..L-1 and, in each layer, heads 0..h-1, each
    once, so no figure is sized by an index the records do not hold.  The summary is derived
    from the records (:func:`summary`, with the stored thresholds), so it says what they say.

    Raises:
        ConfigError: naming the first bad field (``records[3].logit_std``).
    """
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where}: {what}; not a report written by attnscale inspect.")

    if not isinstance(payload, dict):
        raise bad(f"the file holds {type(payload).__name__}, not an object")
    for key, kind in (("meta", dict), ("summary", dict), ("owner", str), ("layers", list),
                      ("fields", dict), ("records", list)):
        if key not in payload:
            raise bad(f"it lacks {key!r}")
        if not isinstance(payload[key], kind):
            raise bad(f"{key} must be {'a string' if kind is str else f'a {kind.__name__}'}, "
                      f"got {json_text(payload[key])}")
    rows = payload["records"]
    if not rows:
        raise bad("records is empty")
    kinds = {key: FIELD_KINDS.get(key, "number") for key in FIELDS}
    heads: dict[int, set[int]] = {}
    for i, row in enumerate(rows):
        _check_kinds(row, kinds, f"records[{i}]", bad)
        if row["head"] in heads.setdefault(row["layer"], set()):
            raise bad(f"records[{i}] repeats layer {row['layer']} head {row['head']}")
        heads[row["layer"]].add(row["head"])
    # layers 0..L-1 and heads 0..h-1: what the figures index, so none is sized by an index the
    # records do not hold
    missing = next((i for i in range(len(heads)) if i not in heads), None)
    if missing is not None:
        raise bad(f"records hold layer {max(heads)} but skip layer {missing}")
    for layer in range(len(heads)):
        if max(heads[layer]) != len(heads[layer]) - 1:
            raise bad(f"records of layer {layer} hold head {max(heads[layer])} but skip a head "
                      "below it")
    _check_kinds(payload["meta"], META_KINDS, "meta", bad)
    if payload["meta"]["whatif"] is not None:  # the report reads its mechanism and options
        from attnscale.mechanisms import parse_variant
        try:
            parse_variant(payload["meta"]["whatif"], param="meta.whatif")
        except ConfigError as err:
            raise bad(str(err).rstrip(".")) from None
    for i, row in enumerate(payload["layers"]):
        _check_kinds(row, LAYER_KINDS, f"layers[{i}]", bad)
        if row["layer"] not in heads:
            raise bad(f"layers[{i}].layer {row['layer']} is no layer of the records")
    thresholds = payload["summary"].get("thresholds")
    _check_kinds(thresholds, {"max_weight": "number", "entropy_fraction": "number"},
                 "summary.thresholds", bad)
    try:
        weight, entropy = check_thresholds(thresholds["max_weight"],
                                           thresholds["entropy_fraction"],
                                           weight_param="summary.thresholds.max_weight",
                                           entropy_param="summary.thresholds.entropy_fraction")
    except ConfigError as err:
        raise bad(str(err).rstrip(".")) from None
    if not all(isinstance(v, str) for v in payload["fields"].values()):
        raise bad("fields must map each field to its meaning, a string")
    return {**payload, "summary": {**payload["summary"],
                                   **summary(rows, max_weight=weight, entropy_fraction=entropy)}}


def check_thresholds(max_weight: float, entropy_fraction: float, *,
                     weight_param: str = "saturated_weight",
                     entropy_param: str = "saturated_entropy") -> tuple[float, float]:
    """Both saturation thresholds, each in (0, 1)."""
    out = []
    for param, value in ((weight_param, max_weight), (entropy_param, entropy_fraction)):
        v = check_float(param, value, positive=True)
        if v >= 1:
            raise ConfigError(f"{param} must be in (0, 1), got {value!r}.")
        out.append(v)
    return out[0], out[1]


def uniform_max_weight(n: int) -> float:
    """The mean max weight of uniform attention over n causal rows, row i attending keys 0..i:
    H_n / n (H_n the n-th harmonic number), the most any mask of n keys gives it (1/n without
    one).  A head is judged saturated above a threshold only where this is below it."""
    return sum(1.0 / i for i in range(1, n + 1)) / n


def shortest_judged(max_weight: float) -> int:
    """The shortest length at which the saturation rule can fail for a causal model: the least
    n with :func:`uniform_max_weight` (n) below ``max_weight`` (3 at the default 0.75)."""
    n = 1
    while uniform_max_weight(n) >= max_weight:
        n += 1
    return n


def check_judged_length(n: int, max_weight: float = SATURATED_MAX_WEIGHT, *,
                        param: str | None = None) -> None:
    """Refuse a length ``n`` at which every head of a causal model counts as saturated by
    construction (uniform attention's mean max weight is already at the threshold: every row
    of N = 1, two of three weights at N = 2...), before any model is loaded."""
    if uniform_max_weight(n) >= max_weight:
        param = param or spelled("--seq-len", "seq_len")
        raise ConfigError(f"{param} {n} is too short to judge saturation: with {n} key(s) even "
                          f"uniform causal attention has a mean max weight of "
                          f"{uniform_max_weight(n):.3g}, not below the threshold "
                          f"{max_weight:g}, so every head would count as saturated; give "
                          f"{shortest_judged(max_weight)} tokens or more.")


def _check_judged(rows: Sequence[Mapping], max_weight: float) -> None:
    """The measured form of :func:`check_judged_length`, exact for any mask: refuse when a
    head's queries attend so few keys (a length, or a sliding window, under 3) that uniform
    attention over them is already above the max-weight threshold."""
    for r in rows:
        floor = r.get("uniform_max_weight")
        if isinstance(floor, float) and floor >= max_weight:
            param = spelled("--seq-len", "seq_len")
            raise ConfigError(f"{param}: the queries of layer {r['layer']} attend at most "
                              f"{r.get('n_keys')} key(s), so even uniform attention has a mean "
                              f"max weight of {floor:.3g}, not below the threshold "
                              f"{max_weight:g}: every head would count as saturated; measure "
                              f"at {shortest_judged(max_weight)} tokens or more, or with a "
                              f"threshold above {floor:.3g}.")


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return math.nan
    return a / b


def _with_ratio(r: Mapping) -> dict:
    """A measured record with ``entropy_ratio`` and ``sqrt_d``."""
    ln_n = r.get("mean_ln_keys")
    ratio = r["entropy_mean"] / ln_n if ln_n and math.isfinite(ln_n) and ln_n > 0 else math.nan
    d = r.get("d_head")
    return {**r, "entropy_ratio": ratio, "sqrt_d": math.sqrt(d) if d else math.nan}


def is_saturated(r: Mapping, max_weight: float, entropy_fraction: float) -> bool:
    """Whether a head is saturated (see :data:`FIELDS`): its weight concentrated on one key.
    For a head with an attention sink the monitor's max weight and entropy cover the sink, so
    the weight judged is the largest a key takes (``key_max_weight_mean``, measured by
    :func:`attnscale.inspect.measure.sink_key_weight`), and the entropy rule holds only where
    that key outweighs the sink."""
    key = r.get("key_max_weight_mean")
    if isinstance(key, float) and math.isfinite(key):
        sink = r.get("sink_mass_mean")
        sink = sink if isinstance(sink, float) and math.isfinite(sink) else 0.0
        return bool(key > max_weight or (r["entropy_ratio"] < entropy_fraction and key > sink))
    return bool(r["max_weight_mean"] > max_weight or r["entropy_ratio"] < entropy_fraction)


def join(trained: Sequence[dict], init: Sequence[dict] | None = None,
         whatif: Sequence[dict] | None = None, *,
         max_weight: float = SATURATED_MAX_WEIGHT,
         entropy_fraction: float = SATURATED_ENTROPY_FRACTION) -> list[dict]:
    """Rows of :data:`FIELDS` from the measured records of each pass (same layers and heads).

    Raises:
        ConfigError: a head whose queries attend too few keys for the saturation rule to fail
            (:func:`check_judged_length`), or passes that saw other layers or heads.
    """
    _check_judged(trained, max_weight)
    others = {"init": init, "whatif": whatif}
    keyed = {}
    for name, rows in others.items():
        if rows is None:
            continue
        keyed[name] = {(r["layer"], r["head"]): _with_ratio(r) for r in rows}
        if set(keyed[name]) != {(r["layer"], r["head"]) for r in trained}:
            raise ConfigError(f"the {name} pass saw other attention layers or heads than the "
                              "checkpoint's; they cannot be compared head by head.")
    out = []
    for raw in trained:
        row = r = _with_ratio(raw)
        row["saturated"] = is_saturated(r, max_weight, entropy_fraction)
        at = (r["layer"], r["head"])
        init_row = keyed.get("init", {}).get(at)
        what_row = keyed.get("whatif", {}).get(at)
        for s in COMPARED:
            row[f"init_{s}"] = None if init_row is None else init_row[s]
            row[f"drift_{s}"] = None if init_row is None else _ratio(r[s], init_row[s])
        for s in COMPARED:
            row[f"whatif_{s}"] = None if what_row is None else what_row[s]
        row["whatif_saturated"] = (None if what_row is None else
                                   is_saturated(what_row, max_weight, entropy_fraction))
        out.append({key: row.get(key) for key in FIELDS})
    return out


def median(rows: Sequence[Mapping], key: str) -> float:
    """Median of ``key`` over the rows where it is a finite number (NaN when none is)."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))
              and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return statistics.median(values) if values else math.nan


def within(value: float, factor: float = PREMISE_FACTOR) -> bool:
    """Whether ``value`` lies within ``factor`` of 1."""
    return math.isfinite(value) and 1 / factor <= value <= factor


def summary(rows: Sequence[Mapping], *, max_weight: float = SATURATED_MAX_WEIGHT,
            entropy_fraction: float = SATURATED_ENTROPY_FRACTION) -> dict:
    """The numbers the verdict states: head counts, saturated heads, medians over heads of the
    trained statistics, their drift and the initialisation's, and whether the footnote's premise
    and the divisor's calibration held at init and hold now."""
    sat = [r for r in rows if r["saturated"]]
    has_init = any(r.get("init_logit_std") is not None for r in rows)
    out = {
        "heads": len(rows), "layers": len({r["layer"] for r in rows}),
        "d_head": sorted({r["d_head"] for r in rows if r.get("d_head")}),
        "saturated_heads": len(sat),
        "saturated": [{"layer": r["layer"], "head": r["head"],
                       "max_weight_mean": r["max_weight_mean"],
                       "entropy_ratio": r["entropy_ratio"],
                       "jacobian_fro_mean": r["jacobian_fro_mean"]} for r in sat],
        "thresholds": {"max_weight": max_weight, "entropy_fraction": entropy_fraction,
                       "premise_factor": PREMISE_FACTOR},
        **{f"median_{s}": median(rows, s) for s in COMPARED},
        "median_sqrt_d": median(rows, "sqrt_d"),
        "calibrated_now": within(median(rows, "logit_std")),
    }
    if has_init:
        out.update({f"median_init_{s}": median(rows, f"init_{s}") for s in COMPARED})
        out.update({f"median_drift_{s}": median(rows, f"drift_{s}") for s in COMPARED})
        out["premise_at_init"] = (within(out["median_init_q_rms"])
                                  and within(out["median_init_k_rms"]))
        out["calibrated_at_init"] = within(out["median_init_logit_std"])
    if any(r.get("whatif_logit_std") is not None for r in rows):
        out["whatif_saturated_heads"] = sum(bool(r["whatif_saturated"]) for r in rows)
        out.update({f"median_whatif_{s}": median(rows, f"whatif_{s}") for s in COMPARED})
    return out
