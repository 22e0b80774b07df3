"""The small-LM stability study: which mechanism keeps a small LM trainable across learning
rates (Wortsman et al. 2023, arXiv 2309.14322), as LR sensitivity per (variant, width) over seeds,
its claims, and four figures; an ``lm`` store of every variant x lr x width x seed, a ``wide``
store of a few variants at a larger width on one seed, and a ``sinks`` store of the normalisers
trained four times longer at one learning rate for their attention-sink rate (both the default
study only).

A run record is what :func:`attnscale.experiments.lm.train_lm` returns (its ``config`` inside),
the ``result`` of an ``lm`` trial.  LR sensitivity is
:func:`~attnscale.experiments.lm.study.lr_sensitivity` per (variant, width, seed) over the
learning rates present, reported as the mean over seeds with the seed-to-seed range [min, max].
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from attnscale.experiments.lm.study import (
    DEFAULT_SEEDS, DEFAULT_VARIANTS, DEFAULT_WIDTHS, QUICK_VARIANTS, SINK_LR, SINK_SEEDS,
    SINK_STEPS, SINK_THRESHOLD, SINK_VARIANTS, SINK_WIDTH, WIDE_SEEDS, WIDE_VARIANTS, WIDE_WIDTHS,
    WORTSMAN_LRS, lr_sensitivity, normalises_qk, parse_variant, peak_logit, plotted_loss,
    sink_rate, variant, variant_text,
)
from attnscale.study import claims as claim_rules
from attnscale.study.registry import register
from attnscale.study.seeds import spread
from attnscale.study.spec import Analysis, Option, Study, Trials

SUMMARY = "lm_study.json"
FIGURES = {"loss_vs_lr": "lm_loss_vs_lr.png", "sensitivity": "lm_lr_sensitivity.png",
           "logit_growth": "lm_attn_logit_growth.png", "entropy": "lm_attn_entropy.png"}
COLUMNS = ["mechanism", "width", "seeds", "mean", "min", "max"]


def _groups(records: Iterable[dict], *keys) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        c = r["config"]
        key = tuple(variant(r) if k == "variant" else c[k] for k in keys)
        out.setdefault(key, []).append(r)
    return out


def variants(records: Sequence[dict]) -> list[str]:
    """The variants of ``records`` in the order they first appear (every table's row order)."""
    return list(dict.fromkeys(variant(r) for r in records))


def lr_grid(records: Sequence[dict]) -> list[float]:
    """The learning rates of the study: every one its records hold (a store's grid is a
    product, so each (variant, width, seed) of a finished study has them all)."""
    return sorted({r["config"]["lr"] for r in records})


def sensitivity_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (variant, width): LR sensitivity per seed, their mean and [min, max].

    Only the seeds whose learning-rate grid is complete count (``seeds``); a seed still part way
    through its grid (a study stopped early) is counted in ``partial`` and left out, since a
    sensitivity over fewer learning rates is another number."""
    grid = lr_grid(records)
    per_seed, partial = {}, {}
    for (var, width, seed), runs in _groups(records, "variant", "d_model", "seed").items():
        runs = sorted(runs, key=lambda r: r["config"]["lr"])
        per_seed.setdefault((var, width), [])
        partial.setdefault((var, width), 0)
        if [r["config"]["lr"] for r in runs] != grid:
            partial[var, width] += 1
            continue
        value = lr_sensitivity([r["final_val_loss"] for r in runs], runs[0]["loss_init"])
        per_seed[var, width].append((seed, value))
    rows = []
    for var in variants(records):
        for width in sorted({w for v, w in per_seed if v == var}):
            seeds = sorted(per_seed[var, width])
            s = spread([v for _, v in seeds])
            rows.append({
                "mechanism": var, "width": width, "seeds": len(seeds),
                "partial": partial[var, width], "lrs": grid,
                "per_seed": [v for _, v in seeds],
                "mean": s["mean"], "min": s["min"], "max": s["max"]})
    return rows


def loss_vs_lr_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (variant, width, lr): mean plotted loss over seeds, diverged seeds, ℓ0."""
    rows = []
    for (var, width, lr), runs in _groups(records, "variant", "d_model", "lr").items():
        rows.append({"mechanism": var, "width": width, "lr": lr,
                     "loss": float(np.mean([plotted_loss(r) for r in runs])),
                     "diverged": sum(bool(r["diverged"]) for r in runs), "seeds": len(runs),
                     "loss_init": float(np.mean([r["loss_init"] for r in runs]))})
    return sorted(rows, key=lambda r: (r["width"], r["lr"]))


def sensitivity_text(row: dict) -> str:
    """A sensitivity row's seed spread, as every study writes one; ``partial`` for a cell whose
    learning-rate grid has not finished on any seed."""
    if not row["seeds"] and row.get("partial"):
        return "partial"
    n = sum(v is not None for v in row["per_seed"])
    return claim_rules.range_text({**row, "n": n})


def _claim(text: str, expected: str, measured: str, verdict: str, agrees: bool | None,
           ours: float | None = None, ci: list | None = None) -> dict:
    """A claim row: what is claimed, what the source says, our number (with its seed range) and
    what we measured in words, the verdict, and ``agrees`` (None: not run)."""
    return {"claim": text, "expected": expected, "ours": ours, "ci": ci, "measured": measured,
            "verdict": verdict, "agrees": agrees}


def _pair_claim(rows: list[dict], a: str, b: str, expect: str, text: str) -> dict:
    """A claim comparing the LR sensitivity of variants a and b at every width both ran.

    ``ours`` is the sensitivity of a minus that of b (mean over widths of the seed means), ``ci``
    its seed-to-seed range (min of a − max of b, max of a − min of b, over widths).
    """
    expected = {"lower": f"{a} lower than {b} (difference < 0)",
                "higher": f"{a} higher than {b} (difference > 0)",
                "overlap": f"{a} within noise of {b} (seed ranges overlap)"}[expect]
    cell = {(r["mechanism"], r["width"]): r for r in rows}
    widths = sorted(w for (m, w) in cell if m == a and (b, w) in cell
                    and cell[m, w]["mean"] is not None and cell[b, w]["mean"] is not None)
    # Compare where both ran the most seeds: a width run on one seed (the wide store) has no
    # seed range, and would take the seed range away from the whole claim.
    most = max((min(cell[a, w]["seeds"], cell[b, w]["seeds"]) for w in widths), default=0)
    widths = [w for w in widths if min(cell[a, w]["seeds"], cell[b, w]["seeds"]) == most]
    if not widths:
        return _claim(text, expected, f"not run ({a} and {b} at a common width needed)",
                      claim_rules.NOT_RUN, None)
    outcomes = [claim_rules.compare(cell[a, w], cell[b, w]) for w in widths]
    measured = "; ".join(f"width {w}: {a} {sensitivity_text(cell[a, w])} vs {b} "
                         f"{sensitivity_text(cell[b, w])} ({o})" for w, o in zip(widths, outcomes))
    one_seed = min(cell[m, w]["seeds"] for w in widths for m in (a, b)) < 2
    if one_seed:
        measured += " [one seed: no seed-to-seed interval, so any gap counts]"
    verdict, agrees = claim_rules.verdict(outcomes, expect)
    ours = float(np.mean([cell[a, w]["mean"] - cell[b, w]["mean"] for w in widths]))
    ci = None if one_seed else [min(cell[a, w]["min"] - cell[b, w]["max"] for w in widths),
                                max(cell[a, w]["max"] - cell[b, w]["min"] for w in widths)]
    return _claim(text, expected, measured, verdict, agrees, ours, ci)


def _growth(cell: dict, name: str, widths: Sequence[int]) -> dict:
    """LR sensitivity at the widest of ``widths`` minus at the narrowest, as a spread: its mean,
    and the range [min at widest − max at narrowest, max at widest − min at narrowest]."""
    hi, lo = cell[name, widths[-1]], cell[name, widths[0]]
    return {"mean": hi["mean"] - lo["mean"], "min": hi["min"] - lo["max"],
            "max": hi["max"] - lo["min"]}


def width_claims(rows: Sequence[dict]) -> list[dict]:
    """Wortsman et al. (2023, Fig. 1): with width, the default's LR sensitivity grows and
    qk-layernorm's does not.  (1) scaled at its widest width is higher than at its narrowest;
    (2) qk-layernorm's growth over the same widths is lower than scaled's."""
    cell = {(r["mechanism"], r["width"]): r for r in rows if r["mean"] is not None}

    def widths_of(*names):
        return sorted(w for (m, w) in cell if m == names[0]
                      and all((n, w) in cell for n in names))

    def one_seed(names, widths):
        return min(cell[n, w]["seeds"] for n in names for w in widths) < 2

    out = []
    text = "scaled's LR sensitivity grows with width (Wortsman et al.)."
    expected = "scaled higher at the widest width than at the narrowest (difference > 0)"
    widths = widths_of("scaled")
    if len(widths) < 2:
        out.append(_claim(text, expected, "not run (scaled at >= 2 widths needed)",
                          claim_rules.NOT_RUN, None))
    else:
        g = _growth(cell, "scaled", widths)
        outcome = claim_rules.compare(cell["scaled", widths[-1]], cell["scaled", widths[0]])
        verdict, agrees = claim_rules.verdict([outcome], "higher")
        measured = ", ".join(f"width {w}: {sensitivity_text(cell['scaled', w])}" for w in widths)
        if one_seed(["scaled"], widths):
            measured += " [a width on one seed: its value has no seed range]"
        out.append(_claim(text, expected, measured, verdict, agrees, g["mean"],
                          [g["min"], g["max"]]))
    text = ("qk-layernorm's LR sensitivity grows less with width than scaled's "
            "(Wortsman et al.).")
    expected = ("growth from the narrowest to the widest width: qk-layernorm lower than scaled "
                "(difference < 0)")
    widths = widths_of("qk-layernorm", "scaled")
    if len(widths) < 2:
        out.append(_claim(text, expected, "not run (qk-layernorm and scaled at >= 2 common "
                          "widths needed)", claim_rules.NOT_RUN, None))
    else:
        ga, gb = _growth(cell, "qk-layernorm", widths), _growth(cell, "scaled", widths)
        verdict, agrees = claim_rules.verdict([claim_rules.compare(ga, gb)], "lower")
        fmt = claim_rules.FMT
        measured = (f"width {widths[0]} to {widths[-1]}: qk-layernorm "
                    f"{fmt.format(ga['mean'])} [{fmt.format(ga['min'])}, {fmt.format(ga['max'])}]"
                    f" vs scaled {fmt.format(gb['mean'])} [{fmt.format(gb['min'])}, "
                    f"{fmt.format(gb['max'])}]")
        if one_seed(["qk-layernorm", "scaled"], widths):
            measured += " [a width on one seed: its value has no seed range]"
        out.append(_claim(text, expected, measured, verdict, agrees, ga["mean"] - gb["mean"],
                          [ga["min"] - gb["max"], ga["max"] - gb["min"]]))
    return out


# A learning rate "still trains" when its final loss (mean over seeds) is within this fraction
# of the best over the LR grid for that variant and width, and no seed diverged.  attnscale's
# own threshold: in the small LM no run diverges outright, even at LR 0.3, so "below the loss
# at init" would call every LR trainable; 10% separates the basin from the slope beyond it.
TRAINS_WITHIN = 0.10


def highest_lr_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (variant, width): the highest learning rate that still trains (mean final
    validation loss over seeds within :data:`TRAINS_WITHIN` of the best over the grid, no seed
    diverged), that mean loss, and the peak max attention logit there (the largest over seeds);
    ``lr`` None when no learning rate has a finite loss."""
    rows = []
    grid = lr_grid(records)
    complete = {key for key, runs in _groups(records, "variant", "d_model", "seed").items()
                if sorted(r["config"]["lr"] for r in runs) == grid}
    groups = _groups(records, "variant", "d_model")
    for var in variants(records):
        for width in sorted(w for v, w in groups if v == var):
            runs_vw = [r for r in groups[var, width]
                       if (var, width, r["config"]["seed"]) in complete]
            by_lr = _groups(runs_vw, "lr")
            losses = {}
            for (lr,), runs in by_lr.items():
                got = [r["final_val_loss"] for r in runs]
                if all(x is not None and math.isfinite(x) for x in got) and \
                        not any(r["diverged"] for r in runs):
                    losses[lr] = float(np.mean(got))
            seeds = {r["config"]["seed"] for r in runs_vw}
            row = {"mechanism": var, "width": width, "lr": None, "loss": None, "best_loss": None,
                   "peak_logit": None, "within": TRAINS_WITHIN, "seeds": len(seeds),
                   "partial": len({r["config"]["seed"] for r in groups[var, width]} - seeds)}
            if losses:
                best = min(losses.values())
                lr = max(x for x, v in losses.items() if v <= (1 + TRAINS_WITHIN) * best)
                peaks = [p for p in map(peak_logit, by_lr[lr,]) if p is not None]
                row.update(lr=lr, loss=losses[lr], best_loss=best,
                           peak_logit=max(peaks) if peaks else None)
            rows.append(row)
    return rows


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    if len(x) < 2 or np.std(rx) == 0 or np.std(ry) == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def logit_claims(records: Sequence[dict]) -> list[dict]:
    """Runs without QK normalisation: (1) the peak attention logit grows with LR (Spearman ρ over
    the grid, per variant, width and seed); (2) every diverged run's peak logit exceeds that of
    the highest learning rate the same variant, width and seed survived."""
    plain = [r for r in records
             if not normalises_qk(r["config"]["mechanism"], r["config"].get("options"))]
    rhos, preceded, total = [], 0, 0
    for key, runs in _groups(plain, "variant", "d_model", "seed").items():
        runs = sorted(runs, key=lambda r: r["config"]["lr"])
        pairs = [(r["config"]["lr"], peak_logit(r)) for r in runs if peak_logit(r) is not None]
        if len(pairs) >= 3:
            rhos.append(_spearman(*zip(*pairs)))
        survived = [r for r in runs if not r["diverged"] and peak_logit(r) is not None]
        for r in runs:
            if r["diverged"] and survived and peak_logit(r) is not None:
                total += 1
                preceded += peak_logit(r) > peak_logit(survived[-1])
    rhos = [x for x in rhos if math.isfinite(x)]
    grow_text = "In runs without qk-norm, the max attention logit grows with LR."
    grow_expected = "Spearman ρ(lr, peak max attention logit) > 0 in every grid (Wortsman et al.)"
    if not rhos:
        grow = _claim(grow_text, grow_expected, "not run (needs >= 3 learning rates)",
                      "not run", None)
    else:
        positive = sum(x > 0 for x in rhos)
        grow = _claim(grow_text, grow_expected,
                      f"Spearman ρ(lr, peak logit) > 0 in {positive} of {len(rhos)} "
                      f"(variant, width, seed) grids; median ρ = {np.median(rhos):.2f}",
                      "agrees" if positive == len(rhos) else
                      "inconclusive: not in every grid" if positive > len(rhos) / 2 else
                      "differs", positive == len(rhos), float(np.median(rhos)),
                      [float(min(rhos)), float(max(rhos))])
    lead_text = "In runs without qk-norm, divergence is preceded by that growth."
    lead_expected = ("every diverged run's peak logit exceeds that of the highest learning rate "
                     "that survived (fraction = 1)")
    if not total:
        lead = _claim(lead_text, lead_expected, "no run diverged beside a surviving one",
                      "not run", None)
    else:
        lead = _claim(lead_text, lead_expected,
                      f"{preceded} of {total} diverged runs reached a higher peak logit than the "
                      "highest learning rate that survived",
                      "agrees" if preceded == total else "differs", preceded == total,
                      preceded / total)
    return [grow, lead]


def claims(records: Sequence[dict]) -> list[dict]:
    """The study's claims (Wortsman et al. and the essay), each with what we measured and a
    verdict."""
    rows = sensitivity_rows(records)
    return [
        *width_claims(rows),
        _pair_claim(rows, "qk-layernorm", "scaled", "lower",
                    "qk-layernorm has lower LR sensitivity than scaled (Wortsman et al.)."),
        _pair_claim(rows, "unscaled", "scaled", "higher",
                    "unscaled has higher LR sensitivity than scaled."),
        _pair_claim(rows, "softcap", "scaled", "lower",
                    "softcap lowers LR sensitivity relative to scaled (the essay: it makes the "
                    "divisor less critical)."),
        _pair_claim(rows, "qk-layernorm(divisor=False)", "qk-layernorm", "overlap",
                    "With QK normalisation, removing 1/√d changes LR sensitivity within noise "
                    "only (the essay)."),
        *logit_claims(records)]


# --- attention sinks -------------------------------------------------------------------------------

def sink_rows(records: Sequence[dict]) -> list[dict]:
    """One row per variant of the ``sinks`` store: the sink rate (share of heads whose mean
    weight on the first key exceeds SINK_THRESHOLD) and the largest head's first-key weight,
    each over seeds (mean, range), and the final validation loss."""
    rows = []
    for var in variants(records):
        runs = [r for r in records if variant(r) == var]
        heaviest = [max((w for layer in r["first_key_weight"] for w in layer), default=None)
                    if r.get("first_key_weight") else None for r in runs]
        rows.append({"mechanism": var, "seeds": len(runs),
                     "sink_rate": spread([sink_rate(r) for r in runs]),
                     "first_key_max": spread(heaviest),
                     "loss": spread([r["final_val_loss"] for r in runs])})
    return rows


def sink_claims(records: Sequence[dict]) -> list[dict]:
    """Softpick's claim (Zuhri et al. 2025, arXiv 2504.20966): no attention sinks, where softmax
    attention has them.  (1) softpick's sink rate is lower than scaled's; (2) it is 0.  Empty
    without the ``sinks`` store's runs."""
    cell = {r["mechanism"]: r for r in sink_rows(records)}
    if "softpick" not in cell or "scaled" not in cell:
        return []
    soft, scaled = cell["softpick"]["sink_rate"], cell["scaled"]["sink_rate"]
    if soft["mean"] is None or scaled["mean"] is None:
        return []
    setup = (f"width {SINK_WIDTH}, lr {SINK_LR:g}, {records[0]['config']['steps']} steps; "
             f"sink rate = share of heads whose mean weight on the first key exceeds "
             f"{SINK_THRESHOLD:g} (Gu et al. 2024)")
    measured = f"softpick {claim_rules.range_text(soft)} vs scaled {claim_rules.range_text(scaled)} ({setup})"
    if scaled["max"] == 0:
        verdict, agrees = ("inconclusive: scaled has no sinks here (rate 0), so there is none to "
                           "remove"), False
    else:
        verdict, agrees = claim_rules.verdict([claim_rules.compare(soft, scaled)], "lower")
    out = [_claim("softpick's attention-sink rate is lower than scaled's (Zuhri et al. 2025).",
                  "softpick lower than scaled (seed ranges apart)", measured, verdict, agrees,
                  soft["mean"] - scaled["mean"],
                  [soft["min"] - scaled["max"], soft["max"] - scaled["min"]])]
    zero = soft["max"] == 0
    out.append(_claim("softpick has no attention sinks: a sink rate of 0 (Zuhri et al. 2025).",
                      "0 on every seed", f"softpick {claim_rules.range_text(soft)} ({setup})",
                      "agrees" if zero else "differs: some head sinks", zero, soft["mean"],
                      [soft["min"], soft["max"]]))
    return out


def _sink_markdown(records: Sequence[dict]) -> list[str]:
    """The fragment's attention-sink section: the table of :func:`sink_rows`."""
    c0 = records[0]["config"]
    lines = ["#### Attention sinks", "",
             f"The same LM at width {c0['d_model']} and lr {c0['lr']:g}, trained for "
             f"{c0['steps']} steps; each head's mean attention weight on the first key of the "
             "validation windows, under its normaliser.  Sink rate: the share of heads (over "
             f"layers) above {SINK_THRESHOLD:g} (Gu et al. 2024); mean [seed min, max].", "",
             "| mechanism | sink rate | largest first-key weight | final loss |",
             "|---|---|---|---|"]
    for r in sink_rows(records):
        lines.append(f"| {r['mechanism']} | {claim_rules.range_text(r['sink_rate'])} | "
                     f"{claim_rules.range_text(r['first_key_max'])} | {claim_rules.range_text(r['loss'])} |")
    return lines + [""]


# --- figures --------------------------------------------------------------------------------------

def _cycle(index: int) -> str:
    import matplotlib.pyplot as plt
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return cycle[index % len(cycle)]


def _style(var: str) -> dict:
    """Line style of a variant: its mechanism's one fixed style (:func:`attnscale.styles.style`),
    dotted for a variant with options so that it stands apart from its mechanism."""
    from attnscale.styles import style
    name = var.split("(")[0]
    return style(name, linestyle=":") if var != name else style(name)


def figure_loss_vs_lr(records: Sequence[dict]):
    """Final validation loss vs peak LR, one line per variant, one panel per width (Wortsman
    Fig. 1); diverged runs are drawn at the loss at init and marked with a cross."""
    from attnscale.plotting import new_figure
    rows = loss_vs_lr_rows(records)
    widths = sorted({r["width"] for r in rows})
    fig, axes = new_figure(len(widths), width=4.2, height=3.4)
    for ax, width in zip(axes, widths):
        for var in variants(records):
            rs = [r for r in rows if r["mechanism"] == var and r["width"] == width]
            if not rs:
                continue
            st = _style(var)
            ax.plot([r["lr"] for r in rs], [r["loss"] for r in rs], ms=3, label=var, **st)
            bad = [r for r in rs if r["diverged"]]
            ax.plot([r["lr"] for r in bad], [r["loss"] for r in bad], "x", color=st["color"],
                    ms=8, mew=2)
        init = np.mean([r["loss_init"] for r in rows if r["width"] == width])
        ax.axhline(init, color="gray", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_title(f"width {width}")
        ax.set_xlabel("peak learning rate")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("final validation loss (nats/byte)")
    axes[-1].legend(fontsize=7)
    return fig


def figure_sensitivity(records: Sequence[dict]):
    """LR sensitivity vs width per variant; bars span the seed-to-seed range."""
    from attnscale.plotting import new_figure
    rows = [r for r in sensitivity_rows(records) if r["mean"] is not None]
    fig, (ax,) = new_figure(1, width=5.0, height=3.6)
    for var in variants(records):
        rs = [r for r in rows if r["mechanism"] == var]
        if not rs:
            continue
        x = [r["width"] for r in rs]
        y = [r["mean"] for r in rs]
        err = [[r["mean"] - r["min"] for r in rs], [r["max"] - r["mean"] for r in rs]]
        ax.errorbar(x, y, yerr=err, ms=4, capsize=3, label=var, **_style(var))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("width (d_model)")
    ax.set_ylabel("LR sensitivity (nats/byte)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _max_over_layers(record: dict, key: str, reduce) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in record["trace"]:
        got = [v for v in row[key] if v is not None and math.isfinite(v)]
        if got:
            steps.append(row["step"])
            values.append(reduce(got))
    return steps, values


def _panels(records: Sequence[dict]):
    from attnscale.plotting import new_figure
    names = variants(records)
    fig, axes = new_figure(len(names), width=3.4, height=3.0)
    return fig, list(zip(names, axes))


def figure_logit_growth(records: Sequence[dict]):
    """Max attention logit over training (max over layers), one panel per variant: the highest
    LR it survives (solid) and the lowest it does not (dashed), per width, first seed."""
    fig, panels = _panels(records)
    for name, ax in panels:
        widths = sorted({r["config"]["d_model"] for r in records if variant(r) == name})
        for j, width in enumerate(widths):
            runs = [r for r in records if variant(r) == name and r["config"]["d_model"] == width]
            seed = min(r["config"]["seed"] for r in runs)
            runs = sorted((r for r in runs if r["config"]["seed"] == seed),
                          key=lambda r: r["config"]["lr"])
            ok = [r for r in runs if not r["diverged"]]
            bad = [r for r in runs if r["diverged"]]
            c = _cycle(j)
            for r, ls, what in ((ok[-1] if ok else None, "-", "survives"),
                                (bad[0] if bad else None, "--", "diverges")):
                if r is None:
                    continue
                ax.plot(*_max_over_layers(r, "attn_logit_max", max), ls, color=c,
                        label=f"w{width} lr {r['config']['lr']:g} {what}")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
        ax.grid(True, which="both", alpha=0.3)
    panels[0][1].set_ylabel("max |attention logit|")
    return fig


def figure_entropy(records: Sequence[dict]):
    """Min attention entropy over training (min over layers and heads of a head's mean entropy),
    one panel per variant, one line per LR, largest width, first seed."""
    import matplotlib.pyplot as plt
    fig, panels = _panels(records)
    lrs = sorted({r["config"]["lr"] for r in records})
    cmap = plt.get_cmap("viridis")
    for name, ax in panels:
        runs = [r for r in records if variant(r) == name]
        width = max(r["config"]["d_model"] for r in runs)
        seed = min(r["config"]["seed"] for r in runs)
        for r in sorted(runs, key=lambda r: r["config"]["lr"]):
            c = r["config"]
            if c["d_model"] != width or c["seed"] != seed:
                continue
            color = cmap(lrs.index(c["lr"]) / max(1, len(lrs) - 1))
            ax.plot(*_max_over_layers(r, "entropy_min", min), color=color,
                    ls="--" if r["diverged"] else "-", label=f"lr {c['lr']:g}")
        ax.set_title(f"{name} (width {width})", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
        ax.grid(True, alpha=0.3)
    panels[0][1].set_ylabel("min attention entropy (nats)")
    return fig


# --- the fragment and the spec --------------------------------------------------------------------

def markdown(records: Sequence[dict], claim_rows: Sequence[dict],
             sinks: Sequence[dict] = ()) -> str:
    """fragment.md: setup, LR sensitivity table, the attention-sink runs (``sinks``' records,
    when any), ``claim_rows`` (:func:`claims`) with their verdicts, figures (headings of level 4
    and below: the report puts the fragment under its own level-3 title)."""
    rows = sensitivity_rows(records)
    widths = sorted({r["width"] for r in rows})
    cell = {(r["mechanism"], r["width"]): r for r in rows}
    c0 = records[0]["config"]
    seeds = max(r["seeds"] for r in rows)
    lrs = sorted({r["config"]["lr"] for r in records})
    lines = [
        f"A causal byte-level LM ({c0['n_layers']} layers, {c0['n_heads']} heads, context "
        f"{c0['seq_len']}, {c0['steps']} steps of batch {c0['batch_size']}) trained with "
        "Wortsman et al.'s recipe (AdamW β = (0.9, 0.95), independent weight decay 1e-4, warm-up "
        "then cosine decay, clipping 1.0, z-loss 1e-4) on the running Python's standard library, "
        f"at peak learning rates {', '.join(f'{x:g}' for x in lrs)}, {seeds} seed(s) per cell.",
        "",
        "#### LR sensitivity",
        "",
        "E over η of [min(ℓ(η), ℓ0) − ℓ*] in nats per byte (Wortsman et al. 2023), ℓ0 the loss "
        "at init and ℓ* the best over the grid: mean over seeds [seed-to-seed min, max]; lower "
        "is more robust.", "", *_width_table(records, widths, cell, sensitivity_text)]
    thin = sorted({r["width"] for r in rows if 0 < r["seeds"] < seeds and not r["partial"]})
    if thin:
        lines += ["", f"Width {', '.join(map(str, thin))} ran on fewer seeds (a blank cell: that "
                  "variant did not run there); a single seed has no seed range."]
    unfinished = [r for r in rows if r["partial"]]
    if unfinished:
        lines += ["", f"{len(unfinished)} cell(s) have a seed whose learning-rate grid has not "
                  "finished (the study was stopped part way): such a seed is left out of its "
                  "cell, the claims and the highest-LR table, and a cell with no finished seed "
                  "reads `partial`."]
    best = {(r["mechanism"], r["width"]): r for r in highest_lr_rows(records)}
    lines += ["", "#### Highest learning rate that trains", "",
              f"The highest peak LR whose final validation loss (mean over seeds) is within "
              f"{TRAINS_WITHIN:.0%} of the best over the grid, no seed diverging: the LR, that "
              "loss (nats/byte) and the peak max attention logit over training (largest over "
              "seeds).", "", *_width_table(records, widths, best, _best_text)]
    if sinks:
        lines += ["", *_sink_markdown(sinks)[:-1]]
    lines += ["", "#### Claims", "", "| claim | measured | verdict |", "|---|---|---|"]
    for c in claim_rows:
        lines.append(f"| {c['claim']} | {c['measured']} | {c['verdict']} |")
    lines += ["", f"![final validation loss vs learning rate]({FIGURES['loss_vs_lr']})",
              "", f"![LR sensitivity vs width]({FIGURES['sensitivity']})",
              "", f"![max attention logit over training]({FIGURES['logit_growth']})",
              "", f"![min attention entropy over training]({FIGURES['entropy']})", ""]
    return "\n".join(lines)


def _width_table(records: Sequence[dict], widths: Sequence[int], cell: Mapping[tuple, dict],
                 text) -> list[str]:
    """A markdown table of one row per variant and one column per width, ``text(cell)`` in each
    (blank where the variant did not run at that width)."""
    lines = ["| mechanism | " + " | ".join(f"width {w}" for w in widths) + " |",
             "|---|" + "---|" * len(widths)]
    for var in variants(records):
        lines.append(f"| {var} | " + " | ".join(
            text(cell[var, w]) if (var, w) in cell else "" for w in widths) + " |")
    return lines


def _best_text(row: dict) -> str:
    """A highest-LR cell: ``lr 0.01: loss 1.234, logit 56.7``; ``none`` when no LR trains,
    ``partial`` when no seed has finished its learning-rate grid."""
    if row["lr"] is None:
        return "partial" if not row["seeds"] and row.get("partial") else "none"
    logit = "n/a" if row["peak_logit"] is None else f"{row['peak_logit']:.1f}"
    return f"lr {row['lr']:g}: loss {row['loss']:.3f}, logit {logit}"


def fragment_claims(claim_rows: Sequence[dict]) -> list[dict]:
    """The claim rows of fragment.json (``attnscale reproduce --include``): quantity, expected,
    ours, ci, verdict, agrees, note; claims that could not be measured are left out."""
    return [claim_rules.claim(c["claim"], c["expected"], c["ours"], c["ci"], c["verdict"],
                              c["agrees"], c["measured"])
            for c in claim_rows if c["agrees"] is not None]


def study_records(stores: Mapping[str, list[dict]]) -> list[dict]:
    """The run records of every store of the study (the ``lm`` grid, then the ``wide`` one)."""
    return [r["result"] for key in ("lm", "wide") for r in stores.get(key, [])]


def analyse(stores: Mapping[str, list[dict]]) -> Analysis:
    """LR sensitivity, highest-trainable-LR and loss-vs-LR tables, every claim, and the four
    figures."""
    if stores.get("wide") and stores.get("lm"):
        # The two stores are drawn as one grid (widths side by side): they may differ only in
        # the grid's axes, as the runs of one store may.
        from attnscale.study.launcher import check_pooling
        check_pooling(STUDY, "lm", [*stores["lm"], *stores["wide"]],
                      where=" in its stores lm and wide")
    records = study_records(stores)
    sinks = [r["result"] for r in stores.get("sinks", [])]
    all_claims = claims(records) + sink_claims(sinks)
    rows = sensitivity_rows(records)
    tables = {"sensitivity": rows, "highest_lr": highest_lr_rows(records),
              "loss_vs_lr": loss_vs_lr_rows(records), "claims": all_claims}
    if sinks:
        tables["sinks"] = sink_rows(sinks)
    figures = {FIGURES["loss_vs_lr"]: lambda: figure_loss_vs_lr(records),
               FIGURES["sensitivity"]: lambda: figure_sensitivity(records),
               FIGURES["logit_growth"]: lambda: figure_logit_growth(records),
               FIGURES["entropy"]: lambda: figure_entropy(records)}
    return Analysis(markdown(records, all_claims, sinks), fragment_claims(all_claims), tables,
                    figures,
                    table=rows, columns=COLUMNS, printed={"sensitivity": rows})


def _variant(text: str) -> str:
    """A known mechanism with known options, in its canonical spelling (so that
    ``qk-layernorm(divisor=false)`` and ``qk-layernorm(divisor=False)`` are one value)."""
    return variant_text(*parse_variant(text))


def _positive(value: float) -> float:
    if not value > 0:
        from attnscale.errors import ConfigError
        raise ConfigError(f"--lrs must all be > 0, got {value!r}.")
    return value


def _grid(variants, widths, seeds) -> dict:
    # Width, then seed, slowest: the trials run in this product order, so a study stopped part
    # way holds every variant's whole LR grid at the narrower widths and first seeds, each of
    # which is an LR sensitivity, rather than some variants at every width and none of the rest.
    return {"d_model": tuple(widths), "seed": tuple(seeds), "variant": tuple(variants),
            "lr": WORTSMAN_LRS}


STUDY = register(Study(
    name="lm",
    title="Which mechanism keeps a small LM trainable across learning rates",
    doc="Which mechanism keeps a small byte-level LM trainable across learning rates "
        "(Wortsman et al. 2023's LR sensitivity): every variant x learning rate x width x seed, "
        "trained with their recipe, a few variants at a wider width on one seed, and the "
        "normalisers trained longer for their attention-sink rate; claims on the growth of LR "
        "sensitivity with width, on qk-layernorm, unscaled, softcap and the 1/√d divisor under "
        "QK normalisation, on the growth of attention logits, and on softpick's sinks.",
    stores={"lm": Trials("lm", _grid(DEFAULT_VARIANTS, DEFAULT_WIDTHS, DEFAULT_SEEDS), folder=""),
            "wide": Trials("lm", _grid(WIDE_VARIANTS, WIDE_WIDTHS, WIDE_SEEDS), folder="wide",
                           default_only=True),
            "sinks": Trials("lm", {"seed": SINK_SEEDS, "variant": SINK_VARIANTS},
                            {"d_model": SINK_WIDTH, "lr": SINK_LR, "steps": SINK_STEPS},
                            folder="sinks", default_only=True)},
    quick={"lm": Trials("lm", _grid(QUICK_VARIANTS, DEFAULT_WIDTHS[:1], DEFAULT_SEEDS[:1]),
                        folder="")},
    quick_doc=f"{', '.join(QUICK_VARIANTS)} x {len(WORTSMAN_LRS)} LRs x width "
              f"{DEFAULT_WIDTHS[0]} x seed {DEFAULT_SEEDS[0]}",
    analyse=analyse, summary=SUMMARY, figures=tuple(FIGURES.values()),
    page_figures={FIGURES["sensitivity"]: "LR sensitivity vs width",
                  FIGURES["loss_vs_lr"]: "final validation loss vs learning rate"},
    options=(
        Option("--mechanisms", "variant", "comma-separated variants, e.g. "
               "'scaled,qk-layernorm(divisor=False)'", check=_variant),
        Option("--lrs", "lr", "comma-separated peak learning rates (Wortsman et al.'s grid)",
               check=_positive),
        Option("--widths", "d_model", "comma-separated widths", minimum=1),
        Option("--seeds", "seed", "comma-separated seeds", minimum=0),
        Option("--steps", "steps", "optimiser steps per run", axis=False, minimum=1),
        Option("--data", "data", "text file or folder", axis=False, metavar="PATH",
               default_text="the running Python's stdlib .py files"),
    ),
    examples="""
  attnscale study lm --out s/ --mechanisms "scaled,qk-layernorm(divisor=False)" --lrs 1e-3,1e-2
""",
))
