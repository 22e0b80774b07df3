"""A training run's temperature, step by step: every statistic of every head against the step, the
fresh initialisation as step 0, and where the logit std's growth came from.

Input: the reports (:func:`attnscale.inspect.inspect_model` payloads, or the ``records.json`` of
their folders) of a run's checkpoints in step order, each measured with its initialisation on the
same tokens.  With the same seed the init pass is the same for every checkpoint; that is checked
(to :data:`INIT_RTOL`) and the first checkpoint's ``init_`` fields are step 0.

The split.  One query row's logit std is, exactly without a cap or a bias
(:func:`attnscale.stats.qk_row_stats`)::

    std_i(z_i) = scale · √d · q_rms · k_rms · coherence

A head's record, though, holds the *mean over rows* of each factor (:mod:`.records`,
:mod:`.measure`): ``logit_std`` averages every row with a key (a one-key row adds 0), ``q_rms``
and ``k_rms`` the same rows, ``coherence`` only the rows with two keys or more.  A mean of products
is not the product of the means, so with the records' own fields the identity holds only
approximately (to a few per cent on the tiny models of the tests; a cap or a bias widens the gap).
The split is made exact by defining the alignment factor as the residual::

    coherence_factor = logit_std / (scale · √d · q_rms · k_rms)

so that per head, from step 0 to step t (√d is the head's own, constant)::

    ln(logit_std_t / logit_std_0) = ln(scale_t / scale_0) + ln(q_rms_t / q_rms_0)
                                    + ln(k_rms_t / k_rms_0) + ln(coherence_factor_t / ..._0)

to float rounding.  ``coherence_factor`` is the measured ``coherence`` times the rows' mixing
(``coherence_gap`` = coherence_factor ÷ coherence, reported beside it, about 1).  Reading the
terms: coherence is alignment of q with k (the μP argument that q·k grows like d); q_rms and k_rms
are the norms that QK-norm and QK-Clip act on; the scale changes only under a learned temperature.
The scale is each layer's measured softmax scale (its mean where it varies per query); the init
pass's scale is not stored in a report, so step 0 takes the first checkpoint's (exact for a fixed
scale; a ``layers[i]["init_scale"]`` field, where a report has one, is used instead).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from attnscale.errors import ConfigError, check_int
from attnscale.inspect.records import COMPARED, median
from attnscale.inspect.report import LABELS
from attnscale.inspect.report import fmt

# The files this analysis gives beside the reports it reads: its page and its figure.
PAGE, FIGURE = "trajectory.md", "trajectory.png"
# The keys of a report's payload, as inspect_model returns it and records.json stores it.
PAYLOAD_KEYS = ("meta", "summary", "owner", "layers", "fields", "records")
# The factors of a head's logit std that change in training, in the split's order (√d is fixed).
FACTORS = ("scale", "q_rms", "k_rms", "coherence")
FACTOR_LABELS = {"scale": "scale", "q_rms": "q rms", "k_rms": "k rms",
                 "coherence": "coherence (alignment)", "norms": "q rms · k rms (norms)"}
# Two checkpoints' init passes must agree to this relative difference: the same seed and tokens
# give the same fresh weights; float32 sums taken in another thread order differ in the last bits
# (2^-23 ≈ 1.2e-7 per operation, a few hundred operations per statistic).
INIT_RTOL = 1e-5
# A head's share of the log-growth per factor is given only where the logit std moved by more than
# 1 %: the share of a vanishing total is the ratio of two roundings.
SHARE_MIN_GROWTH = math.log(1.01)


# A panel is drawn on a log axis when its positive values span more than this ratio (a decade):
# a linear axis would flatten all but the largest; within a decade a linear one reads better.
LOG_SPAN = 10.0


def scale_axis(ax, values: Sequence[float]) -> bool:
    """Put ``ax``'s y axis on a log scale when the positive ``values`` span more than
    :data:`LOG_SPAN`, labelled 0.1, 0.2, 0.5, 1, 2, 5 as the report's scatter is; whether it
    did."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    positive = [v for v in values if math.isfinite(v) and v > 0]
    if not positive or max(positive) / min(positive) <= LOG_SPAN:
        return False
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    return True


def num(x) -> float:
    """A record's number as a float: None (NaN in records.json) and non-numbers are NaN."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return math.nan
    return float(x)


def check_payload(param: str, payload, where: str = "") -> Mapping:
    """``payload`` checked to be a report's contents (the dict inspect_model returns, or a loaded
    records.json) with at least one record; ``where`` names it in the error."""
    missing = [k for k in PAYLOAD_KEYS if not isinstance(payload, Mapping) or k not in payload]
    if missing:
        raise ConfigError(f"{param}{where} is not an inspect report: it lacks "
                          f"{', '.join(missing)}.")
    if not payload["records"]:
        raise ConfigError(f"{param}{where} holds no records.")
    return payload


def architecture(payload: Mapping) -> tuple:
    """What must agree for two reports to be compared head by head: the family and each head's
    (layer, head, module, d_head)."""
    heads = sorted((r["layer"], r["head"], r["module"], r.get("d_head"))
                   for r in payload["records"])
    return payload["meta"].get("model_type"), tuple(heads)


def layer_scales(payload: Mapping, key: str = "scale") -> dict[int, float]:
    """Each layer's softmax scale: ``key`` (``scale``, or ``init_scale``), its ``mean_scale``
    where it varies per query; NaN where the layer was not observed."""
    out = {}
    for row in payload["layers"]:
        s = num(row.get(key))
        out[row["layer"]] = s if math.isfinite(s) else num(row.get("mean_scale"))
    return out


def coherence_factor(stats: Mapping, scale: float) -> float:
    """``logit_std / (scale · √d · q_rms · k_rms)``: the alignment factor that makes a head's
    split exact (see the module doc); NaN where a factor is not positive and finite."""
    parts = [num(stats.get("logit_std")), scale, math.sqrt(num(stats.get("d_head"))),
             num(stats.get("q_rms")), num(stats.get("k_rms"))]
    if not all(math.isfinite(p) and p > 0 for p in parts):
        return math.nan
    return parts[0] / (parts[1] * parts[2] * parts[3] * parts[4])


def _log_ratio(a: float, b: float) -> float:
    return math.log(a / b) if math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0 \
        else math.nan


def split_growth(now: Mapping, then: Mapping) -> dict:
    """The log-growth of a head's logit std from ``then`` to ``now`` and each factor's part.

    ``now`` and ``then``: ``logit_std``, ``scale``, ``d_head``, ``q_rms``, ``k_rms`` and
    ``coherence_factor``.  Returns ``log_growth`` = ln(logit_std ratio), ``log_<factor>`` for
    each of :data:`FACTORS` (coherence: of ``coherence_factor``), which sum to ``log_growth`` to
    float rounding, ``log_norms`` = log_q_rms + log_k_rms, and ``share_<factor>`` =
    log_<factor> / log_growth (NaN where |log_growth| < :data:`SHARE_MIN_GROWTH`).
    """
    out = {"log_growth": _log_ratio(num(now["logit_std"]), num(then["logit_std"]))}
    for f in FACTORS:
        key = "coherence_factor" if f == "coherence" else f
        out[f"log_{f}"] = _log_ratio(num(now[key]), num(then[key]))
    out["log_norms"] = out["log_q_rms"] + out["log_k_rms"]
    big = math.isfinite(out["log_growth"]) and abs(out["log_growth"]) >= SHARE_MIN_GROWTH
    for f in FACTORS:
        out[f"share_{f}"] = out[f"log_{f}"] / out["log_growth"] if big else math.nan
    return out


def head_stats(record: Mapping, scale: float, prefix: str = "") -> dict:
    """One pass's statistics of a head (``prefix`` ``""``: the checkpoint, ``"init_"``: its
    fresh initialisation), with the scale, the coherence factor and its gap to the coherence."""
    out = {s: num(record.get(prefix + s)) for s in COMPARED}
    out.update(d_head=record.get("d_head"), scale=scale)
    out["coherence_factor"] = coherence_factor(out, scale)
    out["coherence_gap"] = (out["coherence_factor"] / out["coherence"]
                            if out["coherence"] and math.isfinite(out["coherence"]) else math.nan)
    return out


# --- the run's checkpoints ---------------------------------------------------------------------

PARAM = "steps_and_payloads"


def check_run(steps_and_payloads) -> list[tuple[int, Mapping]]:
    """The checkpoints as (step, payload) in step order, checked: at least one, steps ≥ 1 and
    increasing (step 0 is the fresh initialisation), one architecture, each measured with its
    initialisation, the same initialisation for every checkpoint."""
    try:
        pairs = [(step, payload) for step, payload in steps_and_payloads]
    except (TypeError, ValueError):
        raise ConfigError(f"{PARAM} must be a sequence of (step, payload) pairs.") from None
    if not pairs:
        raise ConfigError(f"{PARAM} must hold at least one checkpoint.")
    out: list[tuple[int, Mapping]] = []
    for step, payload in pairs:
        step = check_int(f"{PARAM}'s step", step, minimum=1)
        check_payload(PARAM, payload, f" at step {step}")
        if out and step == out[-1][0]:
            raise ConfigError(f"{PARAM} lists step {step} more than once.")
        if out and step < out[-1][0]:
            raise ConfigError(f"{PARAM} must be in step order; step {step} comes after step "
                              f"{out[-1][0]}.")
        out.append((step, payload))
    first_step, first = out[0]
    arch = architecture(first)
    for step, payload in out:
        if architecture(payload) != arch:
            raise ConfigError(
                f"{PARAM}: the checkpoint at step {step} ({payload['meta'].get('model_type')}, "
                f"{len(payload['records'])} heads) is another architecture than the one at step "
                f"{first_step} ({arch[0]}, {len(first['records'])} heads); a run holds one.")
        if any(r.get("init_logit_std") is None for r in payload["records"]):
            raise ConfigError(f"{PARAM}: the checkpoint at step {step} was measured without its "
                              "initialisation (init=False); the trajectory starts at it.")
    _check_same_init(out)
    return out


def _check_same_init(pairs: Sequence[tuple[int, Mapping]]) -> None:
    """Every checkpoint's init pass equals the first's (same seed and tokens: one fresh model)."""
    (step0, first), rest = pairs[0], pairs[1:]
    ref = {(r["layer"], r["head"]): r for r in first["records"]}
    for step, payload in rest:
        for r in payload["records"]:
            for s in COMPARED:
                a, b = num(r[f"init_{s}"]), num(ref[(r["layer"], r["head"])][f"init_{s}"])
                same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=INIT_RTOL,
                                                                         abs_tol=0.0)
                if not same:
                    raise ConfigError(
                        f"{PARAM}: the initialisation measured with step {step} differs from "
                        f"the one with step {step0} (layer {r['layer']} head {r['head']} "
                        f"init_{s} {a:.6g} against {b:.6g}); measure every checkpoint with the "
                        "same seed and tokens.")


def trajectory_rows(steps_and_payloads: Sequence[tuple[int, Mapping]]) -> list[dict]:
    """One row per (step, layer, head), step 0 (the fresh initialisation) first.

    Each row: ``step``, ``layer``, ``head``, ``module``, ``d_head``, the statistics of
    :data:`~attnscale.inspect.records.COMPARED`, ``scale``, ``coherence_factor`` and
    ``coherence_gap`` (see the module doc), and the split of the log-growth from step 0
    (:func:`split_growth`: ``log_growth``, ``log_<factor>``, ``log_norms``, ``share_<factor>``;
    0 at step 0).  JSON-safe after :func:`attnscale.io.json_safe` (NaN becomes null).
    """
    pairs = check_run(steps_and_payloads)
    first = pairs[0][1]
    init_scales = (layer_scales(first, "init_scale")
                   if all(row.get("init_scale") is not None for row in first["layers"])
                   else layer_scales(first))
    base = {}
    rows = []
    for r in first["records"]:
        stats = head_stats(r, init_scales.get(r["layer"], math.nan), "init_")
        base[(r["layer"], r["head"])] = stats
        rows.append(_row(0, r, stats, stats))
    for step, payload in pairs:
        scales = layer_scales(payload)
        for r in payload["records"]:
            stats = head_stats(r, scales.get(r["layer"], math.nan))
            rows.append(_row(step, r, stats, base[(r["layer"], r["head"])]))
    return rows


def _row(step: int, record: Mapping, stats: Mapping, base: Mapping) -> dict:
    return {"step": step, "layer": record["layer"], "head": record["head"],
            "module": record["module"], **stats, **split_growth(stats, base)}


# --- summaries, report, figure -----------------------------------------------------------------

SPLIT_KEYS = ("log_growth", *(f"log_{f}" for f in FACTORS), "log_norms")


def step_medians(rows: Sequence[Mapping]) -> list[dict]:
    """Per step, the median over heads of every statistic and of every term of the split, and the
    heads whose norms carried more of the log-growth than alignment (|log_norms| >
    |log_coherence|) among those where both are defined."""
    out = []
    for step in sorted({r["step"] for r in rows}):
        rs = [r for r in rows if r["step"] == step]
        both = [r for r in rs if math.isfinite(num(r["log_norms"]))
                and math.isfinite(num(r["log_coherence"]))]
        out.append({"step": step, "heads": len(rs),
                    **{s: median(rs, s) for s in (*COMPARED, "scale", "coherence_factor",
                                                  "coherence_gap", *SPLIT_KEYS)},
                    "split_heads": len(both),
                    "norms_heads": sum(abs(r["log_norms"]) > abs(r["log_coherence"])
                                       for r in both)})
    return out


def verdict(rows: Sequence[Mapping]) -> str:
    """The sentence that answers the essay's question over the run: did the median head's
    temperature drift through alignment (coherence) or through the norms of q and k?"""
    last = step_medians(rows)[-1]
    g, norms, align = last["log_growth"], last["log_norms"], last["log_coherence"]
    scale = last["log_scale"]
    if not all(math.isfinite(x) for x in (g, norms, align)):
        return (f"At step {last['step']} the split is undefined for the median head (a factor "
                "is zero or missing).")
    through = ("the norms of q and k (what QK-norm and QK-Clip act on)" if abs(norms) > abs(align)
               else "alignment, the coherence of q with k (the μP argument)")
    moved = "grew" if g > 0 else "shrank"
    text = (f"From the fresh initialisation (step 0) to step {last['step']} the median head's "
            f"logit std {moved} ×{fmt(math.exp(g))} (log-growth {fmt(g)}): median log-ratios "
            f"{fmt(norms)} through the norms of q and k (q rms ×{fmt(math.exp(last['log_q_rms']))}"
            f", k rms ×{fmt(math.exp(last['log_k_rms']))}) and {fmt(align)} through alignment "
            f"(coherence ×{fmt(math.exp(align))})")
    if math.isfinite(scale) and abs(scale) >= SHARE_MIN_GROWTH:
        text += f", {fmt(scale)} through the scale (×{fmt(math.exp(scale))})"
    return (text + f". The temperature drifted mainly through {through}: the norms carried more "
            f"of the log-growth than alignment in {last['norms_heads']} of {last['split_heads']} "
            "heads.")


def _table(head: Sequence[str], lines: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *["| " + " | ".join(cells) + " |" for cells in lines]]


def render_trajectory(steps_and_payloads: Sequence[tuple[int, Mapping]], *,
                      name: str | None = None, figure: str | None = FIGURE) -> str:
    """The run's page (markdown): the verdict, the medians per step, the split per step and per
    head at the last step.  ``name``: the title (default: the first checkpoint's model type);
    ``figure``: the file name of :func:`draw_trajectory`'s figure beside the page, or None."""
    pairs = check_run(steps_and_payloads)
    rows = trajectory_rows(pairs)
    meds = step_medians(rows)
    meta = pairs[0][1]["meta"]
    title = name or meta.get("model_type", "model")
    last = meds[-1]["step"]
    lines = [f"# Temperature trajectory: {title}", "", "**Verdict.** " + verdict(rows), "",
             f"{len(pairs)} checkpoints (steps {', '.join(str(s) for s, _ in pairs)}) of a "
             f"{meta.get('model_type')} model, {len({r['layer'] for r in rows})} attention "
             f"layers, {meds[0]['heads']} heads, each measured on the same "
             f"{meta.get('seq_len', '?')} tokens; step 0 is the same architecture freshly "
             f"initialised by its own `_init_weights` (seed {meta.get('seed', '?')}), identical "
             f"for every checkpoint (checked to a relative {INIT_RTOL:g}).", ""]
    if figure:
        lines += [f"![statistics per layer against the step, and the split]({figure})", ""]
    lines += ["## Medians over heads, per step", "",
              *_table(["step", *[LABELS[s] for s in COMPARED]],
                      [[str(m["step"]), *[fmt(m[s]) for s in COMPARED]] for m in meds]), "",
              "## Where the logit std's growth came from", "",
              "A head's logit std is scale · √d · q rms · k rms · coherence factor, so its "
              "log-growth from step 0 is the sum of the factors' log-ratios, exactly. The "
              "coherence factor is logit std ÷ (scale · √d · q rms · k rms): the measured "
              "coherence (a mean over rows) times the rows' mixing, whose median ratio "
              f"(coherence gap) is {fmt(meds[0]['coherence_gap'])} at step 0 and "
              f"{fmt(meds[-1]['coherence_gap'])} at step {last}. Coherence is the alignment of "
              "q with k (the μP argument); q rms and k rms are the norms that QK-norm and QK-Clip "
              "act on. Medians over heads of each term (medians do not add up; each head's "
              "terms do).", "",
              *_table(["step", "logit std ×", "log-growth", "scale", "q rms", "k rms", "norms",
                       "coherence", "heads where norms > alignment"],
                      [[str(m["step"]), fmt(math.exp(m["log_growth"])
                                            if math.isfinite(m["log_growth"]) else math.nan),
                        *[fmt(m[k]) for k in ("log_growth", "log_scale", "log_q_rms",
                                              "log_k_rms", "log_norms", "log_coherence")],
                        f"{m['norms_heads']} of {m['split_heads']}"] for m in meds[1:]]), "",
              f"### Per head at step {last}", "",
              "Log-ratios against step 0, and each factor's share of the log-growth (given where "
              f"the logit std moved by more than {fmt(math.expm1(SHARE_MIN_GROWTH) * 100)} %).", "",
              *_table(["layer", "head", "logit std ×", "log-growth", "scale", "q rms", "k rms",
                       "coherence", "share norms", "share coherence"],
                      [[str(r["layer"]), str(r["head"]),
                        fmt(math.exp(r["log_growth"]) if math.isfinite(r["log_growth"])
                            else math.nan),
                        *[fmt(r[k]) for k in ("log_growth", "log_scale", "log_q_rms",
                                              "log_k_rms", "log_coherence")],
                        fmt(r["share_q_rms"] + r["share_k_rms"]), fmt(r["share_coherence"])]
                       for r in rows if r["step"] == last]), ""]
    return "\n".join(lines)


def draw_trajectory(steps_and_payloads: Sequence[tuple[int, Mapping]], path: str | Path, *,
                    name: str | None = None) -> Path:
    """The run's figure: one panel per statistic (the median over each layer's heads against the
    step, one line per layer; log axes for scales), the median split against the step, and the
    split per layer at the last step."""
    import matplotlib
    from matplotlib.ticker import MaxNLocator

    from attnscale.plotting import new_grid, save
    from attnscale.styles import MARKERS, PALETTE

    pairs = check_run(steps_and_payloads)
    rows = trajectory_rows(pairs)
    meds = step_medians(rows)
    steps = [m["step"] for m in meds]
    layers = sorted({r["layer"] for r in rows})
    cmap = matplotlib.colormaps["viridis"]
    panels = len(COMPARED) + 2
    cols = 3
    fig, grid = new_grid(math.ceil(panels / cols), cols, 4.2 * cols,
                         3.2 * math.ceil(panels / cols))
    axes = [ax for line in grid for ax in line]
    by = {(r["step"], r["layer"]): [] for r in rows}
    for r in rows:
        by[(r["step"], r["layer"])].append(r)
    for ax, s in zip(axes, COMPARED):
        drawn = []
        for i, layer in enumerate(layers):
            ys = [median(by[(step, layer)], s) for step in steps]
            drawn += ys
            ax.plot(steps, ys, color=cmap(i / max(1, len(layers) - 1)), lw=1.0, marker=".",
                    label=f"layer {layer}" if len(layers) <= 8 else None)
        log = scale_axis(ax, drawn)
        ax.set_title(LABELS[s] + (" (median per layer, log axis)" if log
                                  else " (median per layer)"), fontsize=9)
        ax.set_xlabel("step")
    if len(layers) <= 8:
        axes[0].legend(fontsize=6)
    terms = [("log_growth", "logit std (total)"), ("log_norms", FACTOR_LABELS["norms"]),
             ("log_coherence", FACTOR_LABELS["coherence"]), ("log_scale", "scale")]
    ax = axes[len(COMPARED)]
    for j, (key, label) in enumerate(terms):
        ax.plot(steps, [m[key] for m in meds], color=PALETTE[j], marker=MARKERS[j], lw=1.2,
                label=label)
    ax.axhline(0.0, color="grey", lw=0.6, ls=":")
    ax.set_title("log-ratio against step 0 (median over heads)", fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=6)
    ax = axes[len(COMPARED) + 1]
    last = [r for r in rows if r["step"] == steps[-1]]
    for j, (key, label) in enumerate(terms):
        ax.plot(layers, [median([r for r in last if r["layer"] == layer], key)
                         for layer in layers], color=PALETTE[j], marker=MARKERS[j], lw=1.2,
                label=label)
    ax.axhline(0.0, color="grey", lw=0.6, ls=":")
    ax.set_title(f"log-ratio at step {steps[-1]} (median per layer)", fontsize=9)
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[panels:]:
        ax.axis("off")
    title = name or pairs[0][1]["meta"].get("model_type", "model")
    fig.suptitle(f"{title}: temperature over training (step 0: fresh initialisation; colour: "
                 f"layer {layers[0]} to {layers[-1]})", fontsize=10)
    save(fig, Path(path))
    return Path(path)

