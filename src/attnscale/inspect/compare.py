"""Several models side by side: one row per model of the numbers its temperature report states
(family, owner, layers × heads, d, and the median over heads of each statistic, trained and at
the architecture's own initialisation), the sentences those numbers support, and a figure of the
distributions over heads, one panel per statistic and one box per model.

Input: the reports (:func:`attnscale.inspect.inspect_model` payloads, or the ``records.json`` of
their folders); nothing is re-measured.  Where a report has its initialisation, the growth of the
median head's logit std is split into the norms of q and k and their alignment as
:mod:`.trajectory` splits a run's (exactly, with the coherence factor; see there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from attnscale.errors import ConfigError
from attnscale.formatting import cell
from attnscale.inspect.records import PREMISE_FACTOR, SATURATED_ENTROPY_FRACTION, median, within
from attnscale.inspect.report import LABELS
from attnscale.inspect.report import fmt
from attnscale.inspect.trajectory import (check_payload, head_stats, layer_scales, num,
                                          scale_axis, split_growth)

# The files this analysis gives beside the reports it reads: its page and its figure.
PAGE, FIGURE = "compare.md", "compare.png"
PARAM = "payloads"
# The statistics compared, in the table's and the figure's order: (record key, label).
COMPARE_STATS = (("logit_std", "logit std"), ("init_logit_std", "logit std at init"),
                 ("coherence", LABELS["coherence"]), ("q_rms", LABELS["q_rms"]),
                 ("k_rms", LABELS["k_rms"]), ("entropy_ratio", LABELS["entropy_ratio"]))


def check_payloads(payloads) -> list[Mapping]:
    """At least two reports, each a report's contents, with distinct names."""
    if isinstance(payloads, Mapping) or not isinstance(payloads, Sequence):
        raise ConfigError(f"{PARAM} must be a list of inspect reports.")
    if len(payloads) < 2:
        raise ConfigError(f"{PARAM} must hold at least 2 reports to compare, got "
                          f"{len(payloads)}.")
    seen = set()
    for i, p in enumerate(payloads):
        check_payload(PARAM, p, f"[{i}]")
        name = model_name(p)
        if name in seen:
            raise ConfigError(f"{PARAM} holds two models named {name!r}; give each its own name.")
        seen.add(name)
    return list(payloads)


def model_name(payload: Mapping) -> str:
    meta = payload["meta"]
    return str(meta.get("name") or meta.get("model_type") or "model")


def owner_mechanisms(layers: Sequence[Mapping]) -> str:
    """The registry mechanisms that own the temperature, per group of layers where they differ:
    ``qk-rmsnorm`` or ``scaled in 5 layers; scaled, softcap in 1``."""
    groups: dict[str, int] = {}
    for row in layers:
        key = ", ".join(row.get("mechanisms") or []) or "unknown"
        groups[key] = groups.get(key, 0) + 1
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{k} in {n} layer{'s' if n > 1 else ''}" for k, n in groups.items())


def compare_rows(payloads: Sequence[Mapping]) -> list[dict]:
    """One row per model, in the given order.

    Fields: ``name``, ``family`` (model_type), ``owner`` (the registry mechanisms owning the
    temperature, :func:`owner_mechanisms`), ``owner_sentence`` (the report's), ``layers``,
    ``heads``, ``heads_per_layer`` (None where it varies), ``d_head`` (list), ``seq_len``,
    ``median_<stat>`` for each of :data:`COMPARE_STATS` and ``median_sqrt_d``,
    ``saturated_heads``, and with an initialisation ``median_drift_logit_std`` (median over heads
    of trained ÷ init) and the medians over heads of the split of each head's log-growth from its
    initialisation (``median_log_growth``, ``median_log_q_rms``, ``median_log_k_rms``,
    ``median_log_norms``, ``median_log_coherence``, ``median_log_scale``), with
    ``norms_heads`` of ``split_heads`` where the norms carried more than alignment (None without
    an initialisation).  JSON-safe after :func:`attnscale.io.json_safe`.
    """
    out = []
    for p in check_payloads(payloads):
        recs, meta = p["records"], p["meta"]
        per_layer = {}
        for r in recs:
            per_layer[r["layer"]] = per_layer.get(r["layer"], 0) + 1
        row = {"name": model_name(p), "family": meta.get("model_type"),
               "owner": owner_mechanisms(p["layers"]), "owner_sentence": p["owner"],
               "layers": len(per_layer), "heads": len(recs),
               "heads_per_layer": (next(iter(per_layer.values()))
                                   if len(set(per_layer.values())) == 1 else None),
               "d_head": sorted({r["d_head"] for r in recs if r.get("d_head")}),
               "seq_len": meta.get("seq_len"),
               **{f"median_{s}": median(recs, s) for s, _ in COMPARE_STATS},
               "median_sqrt_d": median(recs, "sqrt_d"),
               "saturated_heads": sum(bool(r.get("saturated")) for r in recs)}
        row.update(_split_from_init(p))
        out.append(row)
    return out


SPLIT = ("log_growth", "log_q_rms", "log_k_rms", "log_norms", "log_coherence", "log_scale")


def _split_from_init(payload: Mapping) -> dict:
    """The medians of each head's split from its initialisation (None without one)."""
    recs = payload["records"]
    if any(r.get("init_logit_std") is None for r in recs):
        return {"median_drift_logit_std": None, **{f"median_{k}": None for k in SPLIT},
                "norms_heads": None, "split_heads": None}
    scales = layer_scales(payload)
    init = (layer_scales(payload, "init_scale")
            if all(row.get("init_scale") is not None for row in payload["layers"]) else scales)
    splits = [split_growth(head_stats(r, scales.get(r["layer"], math.nan)),
                           head_stats(r, init.get(r["layer"], math.nan), "init_")) for r in recs]
    both = [s for s in splits if math.isfinite(s["log_norms"])
            and math.isfinite(s["log_coherence"])]
    return {"median_drift_logit_std": median(recs, "drift_logit_std"),
            **{f"median_{k}": median(splits, k) for k in SPLIT},
            "norms_heads": sum(abs(s["log_norms"]) > abs(s["log_coherence"]) for s in both),
            "split_heads": len(both)}


# --- report ------------------------------------------------------------------------------------

def _ratio(x) -> str:
    return "—" if x is None or not math.isfinite(x) else f"×{fmt(x)}"


def _names(rows: Sequence[Mapping]) -> str:
    return ", ".join(r["name"] for r in rows) if rows else "none"


def _span(lo: Mapping, hi: Mapping, key: str, mark: str) -> str:
    """``from 0.64 (a) to 1.13 (b)``, or ``0.64 (a)`` where one model holds both ends."""
    if lo is hi:
        return f"{mark}{fmt(lo[key])} ({lo['name']})"
    return f"from {mark}{fmt(lo[key])} ({lo['name']}) to {mark}{fmt(hi[key])} ({hi['name']})"


def findings(rows: Sequence[Mapping]) -> list[str]:
    """What the numbers show, one sentence each, computed from :func:`compare_rows`."""
    out = []
    coh = [r for r in rows if math.isfinite(num(r["median_coherence"]))]
    if coh:
        lo = min(coh, key=lambda r: r["median_coherence"])
        hi = max(coh, key=lambda r: r["median_coherence"])
        near = [r for r in coh if math.isfinite(num(r["median_sqrt_d"]))
                and r["median_coherence"] < math.sqrt(r["median_sqrt_d"])]
        out.append(f"Median coherence runs {_span(lo, hi, 'median_coherence', '')}, where 1 is "
                   "the independent q and k of the √d footnote's premise and √d fully aligned "
                   "ones; "
                   f"{len(near)} of {len(coh)} models sit nearer independence than alignment "
                   f"on a geometric scale (below d^(1/4)): {_names(near)}.")
    grown = [r for r in rows if r["median_drift_logit_std"] is not None
             and math.isfinite(num(r["median_drift_logit_std"]))]
    if grown:
        lo = min(grown, key=lambda r: r["median_drift_logit_std"])
        hi = max(grown, key=lambda r: r["median_drift_logit_std"])
        norms = [r for r in grown if math.isfinite(num(r["median_log_norms"]))
                 and math.isfinite(num(r["median_log_coherence"]))
                 and abs(r["median_log_norms"]) > abs(r["median_log_coherence"])]
        each = "; ".join(f"{r['name']}: norms {fmt(r['median_log_norms'])}, alignment "
                         f"{fmt(r['median_log_coherence'])}" for r in grown)
        out.append(f"Against each architecture's own initialisation the median head's logit std "
                   f"changed {_span(lo, hi, 'median_drift_logit_std', '×')}; split per head into "
                   f"log-ratios (median over heads), the norms of q and k carried more of it "
                   f"than alignment in {len(norms)} of {len(grown)} models ({each}).")
    calibrated = [r for r in rows if within(num(r["median_logit_std"]))]
    out.append(f"The median logit std lies within a factor {PREMISE_FACTOR:g} of 1, the unit "
               f"scale the divisor aims at, in {len(calibrated)} of {len(rows)} models: "
               f"{_names(calibrated)}.")
    out.append("Saturated heads: " + ", ".join(f"{r['name']} {r['saturated_heads']} of "
                                               f"{r['heads']}" for r in rows) + ".")
    return out


def _shape(r: Mapping) -> str:
    if r["heads_per_layer"] is None:
        return f"{r['layers']} layers, {r['heads']} heads"
    return f"{r['layers']} × {r['heads_per_layer']}"


def render_compare(payloads: Sequence[Mapping], *, figure: str | None = FIGURE) -> str:
    """The comparison page (markdown): the table, what it shows, the split of each model's drift
    from its initialisation, and ``figure`` (:func:`draw_compare`'s file beside the page, or
    None)."""
    rows = compare_rows(payloads)
    head = ["model", "family", "owner", "layers × heads", "d", "N",
            *[label for _, label in COMPARE_STATS], "saturated"]
    lines = ["# Temperature comparison: " + ", ".join(r["name"] for r in rows), "",
             " ".join(findings(rows)), "",
             "Medians over heads, each from the model's own report (records.json); logit std "
             "at init is the same architecture freshly initialised by its own `_init_weights`.",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], str(r["family"]), f"`{r['owner']}`", _shape(r),
                 "/".join(str(d) for d in r["d_head"]) or "—", fmt(r["seq_len"], "{}"),
                 *[fmt(r[f"median_{s}"]) for s, _ in COMPARE_STATS],
                 f"{r['saturated_heads']}/{r['heads']}"]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    lines += ["", "## Who owns the temperature", "",
              *[f"- **{r['name']}**: {r['owner_sentence']}" for r in rows], ""]
    with_init = [r for r in rows if r["median_drift_logit_std"] is not None]
    if with_init:
        lines += ["## How each model's logit std left its initialisation", "",
                  "Per head, ln(logit std ÷ init) = ln(scale ratio) + ln(q rms ratio) + "
                  "ln(k rms ratio) + ln(coherence factor ratio), exactly (the coherence factor "
                  "is logit std ÷ (scale · √d · q rms · k rms)); medians over heads, which do not "
                  "add up as each head's terms do.", "",
                  "| model | logit std × | log-growth | q rms | k rms | norms | coherence | "
                  "scale | heads where norms > alignment |", "|---" * 9 + "|"]
        for r in with_init:
            lines.append("| " + " | ".join(
                [cell(r["name"]), _ratio(r["median_drift_logit_std"]),
                 *[fmt(r[f"median_{k}"]) for k in ("log_growth", "log_q_rms", "log_k_rms",
                                                   "log_norms", "log_coherence", "log_scale")],
                 f"{r['norms_heads']} of {r['split_heads']}"]) + " |")
        lines.append("")
    if figure:
        lines += [f"![distributions over heads, one box per model]({figure})", ""]
    return "\n".join(lines)


def draw_compare(payloads: Sequence[Mapping], path: str | Path) -> Path:
    """One panel per statistic of :data:`COMPARE_STATS`, one box (quartiles, whiskers to 1.5 IQR)
    and the heads as points per model; a log axis where a panel's values span more than
    :data:`~attnscale.inspect.trajectory.LOG_SPAN`.  Dotted: 1 (the footnote's premise) for
    logit std, coherence and the rms; the saturation threshold for entropy ÷ ln n; short
    dashes: each model's √d on coherence."""
    from attnscale.plotting import new_grid, save
    from attnscale.styles import PALETTE

    payloads = check_payloads(payloads)
    names = [model_name(p) for p in payloads]
    cols = 3
    n_rows = math.ceil(len(COMPARE_STATS) / cols)
    fig, grid = new_grid(n_rows, cols, max(9.0, 1.1 * len(names) * cols + 3),
                         3.3 * n_rows)
    axes = [ax for line in grid for ax in line]
    for ax, (key, label) in zip(axes, COMPARE_STATS):
        data = [[num(r.get(key)) for r in p["records"]] for p in payloads]
        data = [[v for v in vs if math.isfinite(v)] for vs in data]
        log = scale_axis(ax, [v for vs in data for v in vs])
        if log:
            data = [[v for v in vs if v > 0] for vs in data]
        at = [i for i, vs in enumerate(data) if vs]
        if at:
            box = ax.boxplot([data[i] for i in at], positions=at, widths=0.5, showfliers=False,
                             patch_artist=True)
            for patch, i in zip(box["boxes"], at):
                patch.set(facecolor=PALETTE[i % len(PALETTE)], alpha=0.25)
        for i, vs in enumerate(data):
            # Points spread over the box's width by the golden-ratio sequence: deterministic,
            # so a redraw from the stores is byte for byte the same.
            xs = [i + 0.4 * (((k * 0.6180339887) % 1.0) - 0.5) for k in range(len(vs))]
            ax.scatter(xs, vs, s=6, color=PALETTE[i % len(PALETTE)], alpha=0.7, zorder=3)
        if key in ("logit_std", "init_logit_std", "coherence", "q_rms", "k_rms"):
            ax.axhline(1.0, color="grey", lw=0.6, ls=":")
        if key == "entropy_ratio":
            ax.axhline(SATURATED_ENTROPY_FRACTION, color="red", lw=0.6, ls=":")
        if key == "coherence":
            for i, p in enumerate(payloads):
                top = median(p["records"], "sqrt_d")
                if math.isfinite(top):
                    ax.hlines(top, i - 0.3, i + 0.3, color=PALETTE[i % len(PALETTE)], lw=1.0,
                              ls="--")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=7)
        ax.set_title(label + (" (log axis)" if log else ""), fontsize=9)
    for ax in axes[len(COMPARE_STATS):]:
        ax.axis("off")
    fig.suptitle("Per head, one box per model (dotted: 1, the footnote's premise; red: the "
                 "saturation threshold; dashed on coherence: √d, fully aligned)", fontsize=9)
    save(fig, Path(path))
    return Path(path)
