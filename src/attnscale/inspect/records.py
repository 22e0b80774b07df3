"""The records of ``attnscale inspect``: one flat row per (layer, head), every field documented
in :data:`FIELDS`, and the summary that the report's verdict states.

A row joins three forward passes on the same tokens: the checkpoint (no prefix), the same
architecture freshly initialised by its own ``_init_weights`` (``init_``) and, with a what-if
mechanism, the checkpoint with its temperature swapped (``whatif_``).  ``drift_`` is trained ÷ init.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from attnscale.columns import RECORD_STATS
from attnscale.errors import ConfigError, check_float

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
    "n_keys": "the most keys a query attends (the sequence length for self-attention)",
    "queries": "(batch, query) rows with at least one key",
    **{key: MONITOR_MEANINGS.get(key, "the monitor's statistic of that name "
                                      "(attnscale.columns)") for key in RECORD_STATS},
    "mean_ln_keys": "mean over the rows of ln n, n the keys the row attends",
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
                 f"entropy_ratio < the threshold (default {SATURATED_ENTROPY_FRACTION})",
    **{f"init_{s}": f"{s} of the same architecture freshly initialised by its own "
                    "_init_weights (fixed seed), on the same tokens" for s in COMPARED},
    **{f"drift_{s}": f"{s} / init_{s}: how far training moved it" for s in COMPARED},
    **{f"whatif_{s}": f"{s} with the what-if mechanism in place of the model's temperature "
                      "(null without one)" for s in COMPARED},
    "whatif_saturated": "saturated, under the what-if mechanism (null without one)",
}


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
    """Whether a head is saturated (see :data:`FIELDS`)."""
    return bool(r["max_weight_mean"] > max_weight or r["entropy_ratio"] < entropy_fraction)


def join(trained: Sequence[dict], init: Sequence[dict] | None = None,
         whatif: Sequence[dict] | None = None, *,
         max_weight: float = SATURATED_MAX_WEIGHT,
         entropy_fraction: float = SATURATED_ENTROPY_FRACTION) -> list[dict]:
    """Rows of :data:`FIELDS` from the measured records of each pass (same layers and heads)."""
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
