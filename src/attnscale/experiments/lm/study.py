"""The small-LM stability study's analysis: pure functions over run records.

A run record is what :func:`attnscale.experiments.lm.train_lm` returns (its ``config`` inside), so
these work on a list of records from any source: a loop of ``train_lm`` calls or a sweep store.
A *variant* is a mechanism with its options, named ``qk-layernorm`` or
``qk-layernorm(divisor=False)``: the registry key, plus the options when there are any.

LR sensitivity (Wortsman et al. 2023, arXiv 2309.14322, section 2.2)::

    sensitivity = E_{η in grid} [ min(ℓ(η), ℓ0) − ℓ* ],   ℓ* = min_{η in grid} ℓ(η)

with ℓ(η) the final validation loss at peak learning rate η, ℓ0 the loss at init, and a run whose
loss is not finite counted at ℓ0.  It is computed per (variant, width, seed) over the learning
rates present, and reported as the mean over seeds with the seed-to-seed range [min, max].
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from attnscale.mechanisms import MECHANISMS, canonical_options, check_mechanism

# Wortsman et al. 2023's learning-rate grid (Figure 1).
WORTSMAN_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
# The default study (issue 12): these variants x WORTSMAN_LRS x DEFAULT_WIDTHS x DEFAULT_SEEDS.
DEFAULT_VARIANTS = ("scaled", "unscaled", "qk-layernorm", "qk-layernorm(divisor=False)",
                    "qk-rmsnorm", "cosine", "softcap", "sigma-reparam", "mup")
DEFAULT_WIDTHS = (64, 128)
DEFAULT_SEEDS = (0, 1)
# --quick: these x WORTSMAN_LRS x the smallest width x one seed.
QUICK_VARIANTS = ("scaled", "unscaled", "qk-layernorm", "softcap")

# The study folder's report: fragment.md and fragment.json follow ``attnscale reproduce --include``.
FRAGMENT_FILES = {"markdown": "fragment.md", "json": "fragment.json", "summary": "lm_study.json",
                  "loss_vs_lr": "lm_loss_vs_lr.png", "sensitivity": "lm_lr_sensitivity.png",
                  "logit_growth": "lm_attn_logit_growth.png", "entropy": "lm_attn_entropy.png"}


def variant(record: dict) -> str:
    """The mechanism and its options: ``softcap`` or ``softcap(cap=30)``."""
    c = record["config"]
    opts = c.get("options") or {}
    if not opts:
        return c["mechanism"]
    return c["mechanism"] + "(" + ", ".join(f"{k}={opts[k]}" for k in sorted(opts)) + ")"


def parse_variant(text: str) -> tuple[str, dict]:
    """``"qk-layernorm(divisor=False)"`` -> ``("qk-layernorm", {"divisor": False})``: the inverse of
    :func:`variant`; values read as ``--option`` reads them, by each option's declared type."""
    from attnscale.cli._common import parse_options
    from attnscale.errors import ConfigError
    from attnscale.mechanisms import check_mechanism
    name, sep, rest = text.strip().partition("(")
    if sep and not rest.endswith(")"):
        raise ConfigError(f"mechanism variant {text!r} must look like name(key=value, ...).")
    items = [p.strip() for p in rest[:-1].split(",") if p.strip()] if sep else []
    check_mechanism(name.strip(), param="mechanisms")
    options = parse_options(items, name.strip(), param=f"mechanism variant {text!r}")
    check_mechanism(name.strip(), options, param="mechanisms")
    return name.strip(), canonical_options(name.strip(), options)


def grid(variants: Sequence[str] = DEFAULT_VARIANTS, lrs: Sequence[float] = WORTSMAN_LRS,
         widths: Sequence[int] = DEFAULT_WIDTHS, seeds: Sequence[int] = DEFAULT_SEEDS,
         **fixed) -> list[dict]:
    """The study's run configs (JSON dicts for :func:`attnscale.experiments.lm.train_lm`), every
    variant x lr x width x seed; ``fixed`` sets the other :class:`RunConfig` fields."""
    from attnscale.errors import check_unique
    from attnscale.experiments.lm.train import RunConfig
    for param, values in (("mechanisms", variants), ("lrs", lrs), ("widths", widths),
                          ("seeds", seeds)):
        check_unique(param, list(values))
    parsed = [parse_variant(v) for v in variants]
    return [RunConfig(mechanism=name, options=opts, lr=lr, d_model=width, seed=seed,
                      **fixed).validated().to_json()
            for name, opts in parsed for width in widths for seed in seeds for lr in lrs]


def plotted_loss(record: dict) -> float:
    """min(ℓ, ℓ0), a non-finite ℓ counting as ℓ0: the loss Figure 1 draws and the sensitivity
    averages (a diverged run sits at the loss at init)."""
    loss, init = record["final_val_loss"], record["loss_init"]
    return init if loss is None or not math.isfinite(loss) else min(loss, init)


def lr_sensitivity(losses: Sequence[float | None], loss_init: float) -> float | None:
    """E over the grid of [min(ℓ(η), ℓ0) − ℓ*], ℓ* the best finite ℓ(η); None when no learning
    rate got below ℓ0 (nothing learned, so ℓ* is undefined)."""
    finite = [x for x in losses if x is not None and math.isfinite(x)]
    if not finite or min(finite) >= loss_init:
        return None
    best = min(finite)
    clipped = [loss_init if x is None or not math.isfinite(x) else min(x, loss_init)
               for x in losses]
    return sum(x - best for x in clipped) / len(clipped)


def _groups(records: Iterable[dict], *keys) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        c = r["config"]
        key = tuple(variant(r) if k == "variant" else c[k] for k in keys)
        out.setdefault(key, []).append(r)
    return out


def _order(records: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(variant(r) for r in records))


def sensitivity_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (variant, width): LR sensitivity per seed, their mean and [min, max]."""
    per_seed = {}
    for (var, width, seed), runs in _groups(records, "variant", "d_model", "seed").items():
        runs = sorted(runs, key=lambda r: r["config"]["lr"])
        value = lr_sensitivity([r["final_val_loss"] for r in runs], runs[0]["loss_init"])
        per_seed.setdefault((var, width), []).append((seed, value, [r["config"]["lr"] for r in runs]))
    rows = []
    for var in _order(records):
        for width in sorted({w for v, w in per_seed if v == var}):
            seeds = sorted(per_seed[var, width])
            values = [v for _, v, _ in seeds if v is not None]
            rows.append({
                "mechanism": var, "width": width, "seeds": len(seeds),
                "lrs": seeds[0][2], "per_seed": [v for _, v, _ in seeds],
                "mean": float(np.mean(values)) if values else None,
                "min": min(values, default=None), "max": max(values, default=None)})
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


def peak_logit(record: dict) -> float | None:
    """The largest max |attention logit| over layers and monitored steps of a run."""
    values = [v for row in record["trace"] for v in row["attn_logit_max"]
              if v is not None and math.isfinite(v)]
    return max(values, default=None)


def normalises_qk(mechanism: str, options: dict | None = None) -> bool:
    """Whether a mechanism normalises q and k (its logits do not change when q and k are
    scaled): the ``normalises_qk`` it declares, so no list of names is kept."""
    return bool(MECHANISMS[check_mechanism(mechanism)].normalises_qk)


def _range_text(row: dict) -> str:
    if row["mean"] is None:
        return "n/a"
    if row["seeds"] == 1:
        return f"{row['mean']:.3f}"
    return f"{row['mean']:.3f} [{row['min']:.3f}, {row['max']:.3f}]"


def _compare(a: dict, b: dict) -> str:
    """'lower', 'higher' or 'overlap' for the seed ranges of rows a and b."""
    if a["mean"] is None or b["mean"] is None:
        return "undefined"
    if a["max"] < b["min"]:
        return "lower"
    if a["min"] > b["max"]:
        return "higher"
    return "overlap"


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
    if not widths:
        return _claim(text, expected, f"not run ({a} and {b} at a common width needed)",
                      "not run", None)
    outcomes = [_compare(cell[a, w], cell[b, w]) for w in widths]
    measured = "; ".join(f"width {w}: {a} {_range_text(cell[a, w])} vs {b} "
                         f"{_range_text(cell[b, w])} ({o})" for w, o in zip(widths, outcomes))
    one_seed = min(cell[m, w]["seeds"] for w in widths for m in (a, b)) < 2
    if one_seed:
        measured += " [one seed: no seed-to-seed interval, so any gap counts]"
    if expect == "overlap":
        agrees = all(o == "overlap" for o in outcomes)
        verdict = "agrees" if agrees else "differs: the seed ranges separate"
    else:
        agrees = all(o == expect for o in outcomes)
        wrong = [o for o in outcomes if o not in (expect, "overlap")]
        verdict = ("agrees" if agrees else
                   "differs: the opposite order" if wrong else "inconclusive: within noise")
    ours = float(np.mean([cell[a, w]["mean"] - cell[b, w]["mean"] for w in widths]))
    ci = None if one_seed else [min(cell[a, w]["min"] - cell[b, w]["max"] for w in widths),
                                max(cell[a, w]["max"] - cell[b, w]["min"] for w in widths)]
    return _claim(text, expected, measured, verdict, agrees, ours, ci)


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
    """The issue's claims, each with what we measured and a verdict."""
    rows = sensitivity_rows(records)
    return [
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
    from attnscale.report.figures import new_figure
    rows = loss_vs_lr_rows(records)
    widths = sorted({r["width"] for r in rows})
    fig, axes = new_figure(len(widths), width=4.2, height=3.4)
    for ax, width in zip(axes, widths):
        for var in _order(records):
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
    from attnscale.report.figures import new_figure
    rows = [r for r in sensitivity_rows(records) if r["mean"] is not None]
    fig, (ax,) = new_figure(1, width=5.0, height=3.6)
    for var in _order(records):
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
    from attnscale.report.figures import new_figure
    names = _order(records)
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


# --- report fragment ------------------------------------------------------------------------------

# The study's title in the report's "Beyond the essay" section (fragment.json).
TITLE = "Which mechanism keeps a small LM trainable across learning rates"


def markdown(records: Sequence[dict], claim_rows: Sequence[dict]) -> str:
    """fragment.md: setup, LR sensitivity table, ``claim_rows`` (:func:`claims`) with their
    verdicts, figures (headings of level 4 and below: the report puts the fragment under its own
    level-3 title)."""
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
        "is more robust.", "",
        "| mechanism | " + " | ".join(f"width {w}" for w in widths) + " |",
        "|---|" + "---|" * len(widths)]
    for var in _order(records):
        lines.append(f"| {var} | " + " | ".join(
            _range_text(cell[var, w]) if (var, w) in cell else "" for w in widths) + " |")
    lines += ["", "#### Claims", "", "| claim | measured | verdict |", "|---|---|---|"]
    for c in claim_rows:
        lines.append(f"| {c['claim']} | {c['measured']} | {c['verdict']} |")
    lines += ["", f"![final validation loss vs learning rate]({FRAGMENT_FILES['loss_vs_lr']})",
              "", f"![LR sensitivity vs width]({FRAGMENT_FILES['sensitivity']})",
              "", f"![max attention logit over training]({FRAGMENT_FILES['logit_growth']})",
              "", f"![min attention entropy over training]({FRAGMENT_FILES['entropy']})", ""]
    return "\n".join(lines)


def fragment_claims(claim_rows: Sequence[dict]) -> list[dict]:
    """The claim rows of fragment.json (``attnscale reproduce --include``): quantity, expected,
    ours, ci, verdict, agrees, note; claims that could not be measured are left out."""
    return [{"quantity": c["claim"], "expected": c["expected"], "ours": c["ours"],
             "ci": c["ci"], "verdict": c["verdict"], "agrees": c["agrees"], "note": c["measured"]}
            for c in claim_rows if c["agrees"] is not None]


def write_report(records: Sequence[dict], out_dir, *, force: bool = False) -> dict:
    """Write the study folder's report, all or nothing (:func:`attnscale.io.staged_dir`, whose
    output-folder policy ``force`` overrides): fragment.md and fragment.json (title and claims,
    the contract of ``attnscale reproduce --include``), lm_study.json (sensitivity and
    loss-vs-LR rows, all claims) and the four PNGs.  Returns ``{"files": {...}, "claims": [...]}``.
    """
    import json

    from attnscale.errors import ConfigError
    from attnscale.io import check_output_path, json_safe, staged_dir
    from attnscale.report.figures import save
    if not records:
        raise ConfigError("write_report needs at least one run record.")
    out = check_output_path("out_dir", out_dir, kind="dir", files=FRAGMENT_FILES.values(),
                            force=force)
    all_claims = claims(records)
    summary = json_safe({"sensitivity": sensitivity_rows(records),
                         "loss_vs_lr": loss_vs_lr_rows(records), "claims": all_claims})
    fragment = json_safe({"title": TITLE, "claims": fragment_claims(all_claims)})
    with staged_dir(out, param="out_dir", force=force) as staging:
        def write(key: str, text: str) -> None:
            (staging / FRAGMENT_FILES[key]).write_text(text, "utf-8")
        write("json", json.dumps(fragment, indent=1, allow_nan=False))
        write("summary", json.dumps(summary, indent=1, allow_nan=False))
        write("markdown", markdown(records, all_claims))
        save(figure_loss_vs_lr(records), staging / FRAGMENT_FILES["loss_vs_lr"])
        save(figure_sensitivity(records), staging / FRAGMENT_FILES["sensitivity"])
        save(figure_logit_growth(records), staging / FRAGMENT_FILES["logit_growth"])
        save(figure_entropy(records), staging / FRAGMENT_FILES["entropy"])
    return {"files": {k: str(out / v) for k, v in FRAGMENT_FILES.items()},
            "claims": summary["claims"]}
