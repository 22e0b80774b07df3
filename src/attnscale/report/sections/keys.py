"""Report section: entropy and max weight vs the number of keys n at init, and a planted key.

Two Monte Carlo experiments at ``d_k = 64`` on ``N(0, I)`` queries and keys:

* :func:`attnscale.measure.montecarlo.saturation` for every mechanism defined at init, at
  ``n = 16 .. 65536``: the slope ``dH / d ln n`` of the mean entropy per mechanism;
* :func:`attnscale.measure.planted.planted_key` for scaled and ssmax: the weight on one key that
  leads the others by a fixed margin, and its exponent ``b`` in ``weight ~ n^b`` at large n.

Both slopes come from :func:`attnscale.stats.fit_line`, a weighted least-squares line through
per-n Monte Carlo means with their standard errors (method in its docstring and in the
section's text).  The section is named for the keys: "length" is the trained extrapolation
study (``attnscale study length``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from attnscale.constants import Z95
from attnscale.measure.montecarlo import saturation, shortcut_rule
from attnscale.measure.planted import PLANTED_MARGIN, planted_key
from attnscale.mechanisms import build_mechanism, defined_at_init
from attnscale.report import Measurement, Section
from attnscale.report.figures import new_figure, save
from attnscale.stats import fit_line
from attnscale.styles import style

KEYS_D_K = 64
KEYS_NS = tuple(4 ** i for i in range(2, 9))        # 16, 64, ..., 65536
# Trials per n: a budget of keys per n, clamped.  The cost of a trial grows with n (the
# mechanisms that need q and k hold n * d_k numbers), so large n get fewer trials; the standard
# errors stay below ~0.03 nats there because the per-trial spread of the entropy does not grow.
KEY_BUDGET = 1 << 18
MAX_TRIALS = 256
MIN_TRIALS = 16
# The mechanisms sampled through their own modules (they transform q and k, or read the whole
# row: O(n d_k) a trial, where the chi-square shortcut costs O(n)) carry no claim and only draw
# the figure: half the budget, and as few as 4 trials at the largest n (their entropy's standard
# error there is then at most ~0.05 nats, seed 0, against ln n = 11.1).
MODULE_KEY_BUDGET = KEY_BUDGET // 2
MODULE_MIN_TRIALS = 4
# "Large n" for the planted key's exponent: from here on the 1/n tail dominates the scaled
# weight e^m / (e^m + (n - 1) E[e^z]) (at n = 1024 it is already below 0.1).
EXPONENT_MIN_N = 1024
PLANTED_MECHANISMS = ("scaled", "ssmax")              # the two sides of SSMax's argument


def trials_for(n: int, budget: int = KEY_BUDGET, least: int = MIN_TRIALS) -> int:
    """Monte Carlo trials at ``n`` keys: ``budget // n`` within [least, MAX_TRIALS]."""
    return min(MAX_TRIALS, max(least, budget // n))


def module_trials_for(n: int) -> int:
    """Trials at ``n`` keys of the mechanisms sampled through their modules."""
    return trials_for(n, MODULE_KEY_BUDGET, MODULE_MIN_TRIALS)


def _fit_entropy(rows: list[dict]) -> dict:
    """``dH / d ln n`` of one mechanism's rows."""
    return fit_line([math.log(r["n"]) for r in rows], [r["entropy_mean"] for r in rows],
                    [r["entropy_se"] for r in rows])


def _fit_exponent(rows: list[dict]) -> dict:
    """``b`` in planted weight ~ n^b over n >= EXPONENT_MIN_N: ln of the mean weight on ln n, with
    the delta-method standard error ``se / mean``."""
    rs = [r for r in rows if r["n"] >= EXPONENT_MIN_N]
    return fit_line([math.log(r["n"]) for r in rs],
                    [math.log(r["planted_weight_mean"]) for r in rs],
                    [r["planted_weight_se"] / r["planted_weight_mean"] for r in rs])


def _measurement(fit: dict, note: str) -> Measurement:
    return Measurement(fit["slope"], se=fit["slope_se"], ci95=fit["slope_ci95"], note=note)


def _plot(ax, rows: list[dict], stat: str, names: Sequence[str]) -> None:
    """``<stat>_mean`` vs n on a log2 axis, one styled line per mechanism, 95% error bars."""
    for name in names:
        rs = [r for r in rows if r["mechanism"] == name]
        ax.errorbar([r["n"] for r in rs], [r[f"{stat}_mean"] for r in rs],
                    yerr=[Z95 * r[f"{stat}_se"] for r in rs], label=name, ms=4, lw=1.2,
                    capsize=2, **style(name))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("number of keys $n$")
    ax.grid(True, which="both", alpha=0.3)


def keys_rows(seed: int, ns: Sequence[int] = KEYS_NS, d_k: int = KEYS_D_K,
              trials=trials_for, module_trials=module_trials_for
              ) -> tuple[list[dict], list[dict]]:
    """The section's two experiments: saturation rows for every mechanism defined at init and
    planted-key rows for :data:`PLANTED_MECHANISMS`, with ``trials(n)`` trials at each n (and
    ``module_trials(n)`` for the mechanisms that the chi-square shortcut does not serve)."""
    at_init = defined_at_init()
    sat, planted = [], []
    for n in ns:
        fast = [m for m in at_init if shortcut_rule(build_mechanism(m, 2, 1), n) is not None]
        rows = (saturation((d_k,), n, trials(n), seed, fast)
                + saturation((d_k,), n, module_trials(n), seed,
                             [m for m in at_init if m not in fast]))
        sat += sorted(rows, key=lambda r: at_init.index(r["mechanism"]))
        planted += planted_key(n, d_k, trials(n), seed, PLANTED_MECHANISMS)
    return sat, planted


def _trials_text(by: dict[str, list[dict]]) -> str:
    """'n: trials, ...' of each way of sampling, and the mechanisms sampled through their
    modules when they take other counts."""
    shortcut = [name for name, rows in by.items() if rows[0]["method"] == "chi2-shortcut"]
    modules = [name for name in by if name not in shortcut]

    def counts(name: str) -> str:
        return ", ".join(f"{r['n']}: {r['trials']}" for r in by[name])

    if not shortcut or not modules or counts(shortcut[0]) == counts(modules[0]):
        return counts(next(iter(by)))
    return (f"{counts(shortcut[0])} where the logits are a function of q.k (the chi-square "
            f"shortcut); {counts(modules[0])} for {', '.join(modules)}, sampled through "
            "their own modules (the figure only)")


def build_section(fig_dir: Path, sat_rows: list[dict], planted_rows: list[dict],
                  seed: int) -> Section:
    """Fits, claims, figure and text from the rows of :func:`keys_rows`."""
    names = list(dict.fromkeys(r["mechanism"] for r in sat_rows))
    by = {name: sorted((r for r in sat_rows if r["mechanism"] == name), key=lambda r: r["n"])
          for name in names}
    fits = {name: _fit_entropy(by[name]) for name in names}
    exps = {name: _fit_exponent([r for r in planted_rows if r["mechanism"] == name])
            for name in PLANTED_MECHANISMS}
    ns = [r["n"] for r in by[names[0]]]
    d_k = sat_rows[0]["d_k"]
    span = f"n = {ns[0]}-{ns[-1]}"
    large = f"n = {EXPONENT_MIN_N}-{ns[-1]}"
    lead = f"{large}, lead {planted_rows[0]['margin']:g}, d_k = {d_k}"
    measurements = {
        "keys.scaled.entropy_slope": _measurement(fits["scaled"], f"{span}, d_k = {d_k}"),
        "keys.planted.scaled.exponent": _measurement(exps["scaled"], lead),
        "keys.planted.ssmax.exponent": _measurement(exps["ssmax"], lead),
    }

    fig, (ax1, ax2, ax3) = new_figure(3, width=5.0, height=4.2)
    _plot(ax1, sat_rows, "entropy", names)
    ax1.plot(ns, [math.log(n) for n in ns], color="grey", ls="--", lw=1, label="ln n")
    ax1.set_ylabel("mean entropy (nats)")
    ax1.legend(fontsize=6, ncol=2)
    _plot(ax2, sat_rows, "max_weight", names)
    ax2.set_yscale("log")
    ax2.set_ylabel("mean max attention weight")
    _plot(ax3, planted_rows, "planted_weight", PLANTED_MECHANISMS)
    ref = next(r for r in planted_rows if r["mechanism"] == "scaled" and r["n"] == ns[-1])
    tail = [n for n in ns if n >= EXPONENT_MIN_N]
    ax3.plot(tail, [ref["planted_weight_mean"] * ns[-1] / n for n in tail], color="grey", ls=":",
             lw=1, label="$\\propto 1/n$")
    ax3.set_yscale("log")
    ax3.set_ylabel(f"weight on the planted key (lead {PLANTED_MARGIN:g})")
    ax3.legend(fontsize=7)
    save(fig, fig_dir / "figure_keys_at_init.png")

    def ci(fit: dict) -> str:
        lo, hi = fit["slope_ci95"]
        return f"{fit['slope']:.3f} [{lo:.3f}, {hi:.3f}]"

    lines = [
        f"Settings: d_k = {d_k}, N(0, I) queries and keys, seed {seed}. Every mechanism "
        "defined at init, with its default options; trials per n: " + _trials_text(by) + ".",
        "",
        "Slopes are weighted least-squares lines through the per-n Monte Carlo means (weights "
        "1/se^2). The slope's standard error is scaled by the Birge ratio sqrt(chi2/dof) when "
        "that exceeds 1 (the points scatter about a straight line more than their errors allow, "
        "as they do where the relation is curved), and its 95% CI then uses Student's t on dof "
        "= points - 2; otherwise 1.96.", "",
        f"| mechanism | dH/d ln n [95% CI], {span} | chi2/dof | H at n={ns[0]} | "
        f"H at n={ns[-1]} | ln n - H at n={ns[0]} | ln n - H at n={ns[-1]} |",
        "|---|---|---|---|---|---|---|"]
    for name in names:
        first, last, fit = by[name][0], by[name][-1], fits[name]
        lines.append(
            f"| {name} | {ci(fit)} | {fit['chi2'] / max(fit['dof'], 1):.2f} | "
            f"{first['entropy_mean']:.3f} | {last['entropy_mean']:.3f} | "
            f"{math.log(first['n']) - first['entropy_mean']:.3f} | "
            f"{math.log(last['n']) - last['entropy_mean']:.3f} |")
    lines += [
        "", "#### A planted key (Nakanishi 2025)", "",
        f"Key 0's raw dot product is fixed at q.k_0 = {PLANTED_MARGIN:g} sqrt(d_k): in scaled "
        f"logits it leads the other keys' mean by {PLANTED_MARGIN:g} (their std is about 1), "
        "the lead of SSMax's Figure 1. Exponent b of its weight ~ n^b, fitted on ln of the mean "
        f"weight at {large} (delta-method errors se/mean):", "",
        f"| mechanism | b [95% CI] | weight at n={ns[0]} | weight at n={EXPONENT_MIN_N} | "
        f"weight at n={ns[-1]} |", "|---|---|---|---|---|"]
    for name in PLANTED_MECHANISMS:
        w = {r["n"]: r["planted_weight_mean"] for r in planted_rows if r["mechanism"] == name}
        lines.append(f"| {name} | {ci(exps[name])} | {w[ns[0]]:.4f} | "
                     f"{w[EXPONENT_MIN_N]:.4f} | {w[ns[-1]]:.4g} |")
    fit_rows = ([{"experiment": "entropy_slope", "mechanism": k, **v} for k, v in fits.items()]
                + [{"experiment": "planted_exponent", "mechanism": k, "min_n": EXPONENT_MIN_N,
                    **v} for k, v in exps.items()])
    return Section(
        name="Entropy vs number of keys, at init",
        rows=[dict(r, experiment="keys_saturation") for r in sat_rows]
        + [dict(r, experiment="keys_planted") for r in planted_rows]
        + [dict(r, slope_ci95=list(r["slope_ci95"])) for r in fit_rows],
        measurements=measurements,
        figures=[("figure_keys_at_init.png", f"Entropy (left) and max weight (middle) vs the "
                  f"number of keys at d_k = {d_k}, every mechanism defined at init; right: the "
                  "weight on one planted key, scaled vs ssmax. Bars: 95% CI.")],
        markdown="\n".join(lines),
    )


def report_section(fig_dir: Path, *, seed: int, full: bool = False) -> Section:
    """Entropy and max weight vs n at init for every mechanism, and the planted key."""
    sat_rows, planted_rows = keys_rows(seed)
    return build_section(fig_dir, sat_rows, planted_rows, seed)
