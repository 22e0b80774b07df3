"""Report section for the Monte Carlo experiments: the variance check and Figures 1-2."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from attnscale.mechanisms import MECHANISMS, defined_at_init
from attnscale.measure.montecarlo import (
    ESSAY_D_KS, ESSAY_N, ESSAY_PAIRS, ESSAY_TRIALS, jacobian_crossing, saturation,
    small_head_thresholds, variance,
)
from attnscale.report import Measurement, Section
from attnscale.report.claims import essay
from attnscale.report.figures import new_figure, plot_vs_dk, save
from attnscale.stats import entropy, mean_of_means

# Trials per d_k for the every-mechanism figure, which carries no claim: the mechanisms that
# transform q and k are sampled through their own modules, which costs O(n d_k) per trial
# instead of O(n).  At 100 the largest standard errors (seed 0, AVX2) are 0.024 in the max
# weight and 0.12 nats in the entropy (both where unscaled saturates), against a spread of
# 4.2-5.4 nats between the mechanisms at each d_k; the section's text states the count.
MECHANISM_TRIALS = 100
# Grids around the small-head thresholds: d_k near 2 ln 256 ~ 11, and n near exp(4/2) ~ 7.4.
SMALL_HEAD_D_KS = (2, 4, 6, 8, 11, 16, 24, 32)
SMALL_HEAD_NS = (2, 4, 7, 16, 64, 256, 4096)


def _mean_over(rows: list[dict], stat: str) -> Measurement:
    """Average of ``<stat>_mean`` over independent rows, with its standard error."""
    mean, se = mean_of_means([r[f"{stat}_mean"] for r in rows], [r[f"{stat}_se"] for r in rows])
    return Measurement(mean, se=se, note=f"mean over {len(rows)} d_k")


def _small_head(seed: int) -> tuple[list[dict], str]:
    """Unscaled saturation around the thresholds, as rows and a markdown table."""
    th = small_head_thresholds(ESSAY_N, 4)
    by_dk = saturation(SMALL_HEAD_D_KS, ESSAY_N, ESSAY_TRIALS, seed, ("unscaled",))
    by_n = []
    for n in SMALL_HEAD_NS:
        by_n += saturation((4,), n, ESSAY_TRIALS, seed, ("unscaled",))
    lines = [f"Unscaled logits have std sqrt(d_k), below the condensation threshold "
             f"sqrt(2 ln n) = {th['sigma_threshold']:.3f} while d_k < 2 ln n = "
             f"{th['d_k_threshold']:.2f} (n = {ESSAY_N}); at d_k = 4 that needs "
             f"n < exp(2) = {th['n_threshold']:.2f} keys.", "",
             "| setting | max weight | entropy (nats) | entropy / ln n |", "|---|---|---|---|"]
    for r in by_dk:
        lines.append(f"| n={r['n']}, d_k={r['d_k']} | {r['max_weight_mean']:.3f} | "
                     f"{r['entropy_mean']:.3f} | {r['entropy_mean'] / math.log(r['n']):.3f} |")
    for r in by_n:
        lines.append(f"| d_k=4, n={r['n']} | {r['max_weight_mean']:.3f} | "
                     f"{r['entropy_mean']:.3f} | {r['entropy_mean'] / math.log(r['n']):.3f} |")
    return [dict(th, kind="thresholds")] + by_dk + by_n, "\n".join(lines)


def report_section(fig_dir: Path, *, seed: int, full: bool = False) -> Section:
    """Variance check, Figure 1 (saturation), Figure 2 (Jacobian) and the small-head thresholds."""
    var_rows = variance(ESSAY_D_KS, ESSAY_PAIRS, seed)
    sat_rows = saturation(ESSAY_D_KS, ESSAY_N, ESSAY_TRIALS, seed)
    cross = jacobian_crossing(sat_rows)
    small_rows, small_md = _small_head(seed)
    by = {(r["mechanism"], r["d_k"]): r for r in sat_rows}

    def est(mech: str, d_k: int, stat: str) -> Measurement:
        r = by[mech, d_k]
        return Measurement(r[f"{stat}_mean"], se=r[f"{stat}_se"])

    v64 = next(r for r in var_rows if r["d_k"] == 64)
    worst = max(var_rows, key=lambda r: abs(r["rel_error"]))
    # |rel error| interval per d_k: 0 if the CI straddles 0, else the CI's ends in absolute value.
    abs_lo = max(0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))
                 for lo, hi in (r["rel_error_ci95"] for r in var_rows))
    abs_hi = max(max(abs(lo), abs(hi)) for lo, hi in (r["rel_error_ci95"] for r in var_rows))
    unscaled_j = [by["unscaled", d] for d in ESSAY_D_KS]
    peak = max(unscaled_j, key=lambda r: r["jacobian_fro_mean"])["d_k"]
    th = small_head_thresholds(ESSAY_N, 4)
    scaled_rows = [by["scaled", d] for d in ESSAY_D_KS]

    m = {
        "variance.std.dk64": Measurement(v64["std"], se=v64["std_se"]),
        "variance.max_rel_error": Measurement(
            abs(worst["rel_error"]), ci95=(abs_lo, abs_hi), note=f"worst at d_k={worst['d_k']}"),
        "saturation.scaled.max_weight.dk64": est("scaled", 64, "max_weight"),
        "saturation.scaled.max_weight.dk1024": est("scaled", 1024, "max_weight"),
        "saturation.scaled.entropy.mean": _mean_over(scaled_rows, "entropy"),
        "saturation.unscaled.max_weight.dk4": est("unscaled", 4, "max_weight"),
        "saturation.unscaled.max_weight.dk64": est("unscaled", 64, "max_weight"),
        "saturation.unscaled.max_weight.dk1024": est("unscaled", 1024, "max_weight"),
        "saturation.unscaled.entropy.dk4": est("unscaled", 4, "entropy"),
        "saturation.unscaled.entropy.dk64": est("unscaled", 64, "entropy"),
        "saturation.unscaled.entropy.dk1024": est("unscaled", 1024, "entropy"),
        "saturation.uniform_entropy": Measurement(
            float(entropy(torch.zeros(ESSAY_N, dtype=torch.float64)))),
        "jacobian.scaled.mean": _mean_over(scaled_rows, "jacobian_fro"),
        "jacobian.unscaled.dk4": est("unscaled", 4, "jacobian_fro"),
        "jacobian.unscaled.dk16": est("unscaled", 16, "jacobian_fro"),
        "jacobian.unscaled.dk64": est("unscaled", 64, "jacobian_fro"),
        "jacobian.unscaled.dk256": est("unscaled", 256, "jacobian_fro"),
        "jacobian.unscaled.dk1024": est("unscaled", 1024, "jacobian_fro"),
        "jacobian.unscaled.peak_dk": Measurement(float(peak), note="grid 4..1024"),
        "small_head.dk_threshold.n256": Measurement(th["d_k_threshold"]),
        "small_head.n_threshold.dk4": Measurement(th["n_threshold"]),
    }
    if cross["crosses"]:
        lo, hi = cross["d_k_ci95"]
        m["jacobian.crossing_dk"] = Measurement(
            cross["d_k_estimate"], ci95=(lo or 0.0, math.inf if hi is None else hi),
            note=f"between grid points {cross['d_k_interval'][0]} and {cross['d_k_interval'][1]}")

    mechs = ("scaled", "unscaled")
    fig, (ax1, ax2) = new_figure(2)
    plot_vs_dk(ax1, sat_rows, "max_weight", mechs)
    ax1.set_ylabel("mean max attention weight")
    plot_vs_dk(ax2, sat_rows, "entropy", mechs)
    ax2.axhline(math.log(ESSAY_N), color="grey", ls="--", lw=1, label=f"ln {ESSAY_N}")
    ax2.set_ylabel("mean entropy (nats)")
    ax2.legend()
    save(fig, fig_dir / "figure1_saturation.png")

    fig, (ax,) = new_figure(1, width=6)
    plot_vs_dk(ax, sat_rows, "jacobian_fro", mechs)
    if cross["crosses"]:
        lo, hi = cross["d_k_ci95"]
        ax.axvspan(lo or ESSAY_D_KS[0], hi or ESSAY_D_KS[-1], color="grey", alpha=0.15, label="crossing (95% CI)")
    ax.set_ylabel(r"mean $\|J\|_F$")
    ax.legend()
    save(fig, fig_dir / "figure2_jacobian.png")

    md = (f"Settings: {ESSAY_PAIRS:,} pairs per d_k for the variance check; n = {ESSAY_N} keys and "
          f"{ESSAY_TRIALS} trials per d_k for the figures; seed {seed}. Logits are sampled with the "
          "exact chi-square shortcut (|q|^2 ~ chi2(d_k), q.k_i = |q| g_i).\n\n"
          "### Keep the head small\n\n" + small_md)
    return Section(
        name="Monte Carlo: variance, saturation and the softmax Jacobian",
        rows=[dict(r, experiment="variance") for r in var_rows]
        + [dict(r, experiment="saturation") for r in sat_rows]
        + [dict(cross, experiment="jacobian_crossing")]
        + [dict(r, experiment="small_head") for r in small_rows],
        measurements=m,
        figures=[("figure1_saturation.png", "Figure 1. Mean max attention weight and entropy vs "
                  f"d_k, n = {ESSAY_N} keys: scaled (blue) is flat, unscaled (green) saturates."),
                 ("figure2_jacobian.png", "Figure 2. Mean softmax-Jacobian Frobenius norm vs d_k: "
                  f"unscaled peaks at d_k = {essay('jacobian.unscaled.peak_dk')} and crosses "
                  "below scaled.")],
        markdown=md,
    )


def report_section_mechanisms(fig_dir: Path, *, seed: int,
                              full: bool = False) -> Section:
    """Saturation at init for every mechanism whose temperature is a rule on q and k."""
    at_init = defined_at_init()
    mech_rows = saturation(ESSAY_D_KS, ESSAY_N, MECHANISM_TRIALS, seed, at_init)
    fig, (ax1, ax2) = new_figure(2, width=5.5, height=4.2)
    plot_vs_dk(ax1, mech_rows, "max_weight", at_init)
    ax1.set_ylabel("mean max attention weight")
    ax1.set_yscale("log")
    plot_vs_dk(ax2, mech_rows, "entropy", at_init)
    ax2.set_ylabel("mean entropy (nats)")
    ax2.legend(fontsize=7, ncol=2)
    save(fig, fig_dir / "figure_mechanisms_at_init.png")
    skipped = [name for name in MECHANISMS if name not in at_init]
    # An output gate (gated) is a weight of its own, W_g, not a temperature in W_Q and W_K.
    in_weights = [name for name in skipped if not MECHANISMS[name].gate]
    gated = [name for name in skipped if MECHANISMS[name].gate]

    md = (f"Each mechanism defined at init is applied to N(0, I) queries and keys (n = {ESSAY_N}, "
          f"{MECHANISM_TRIALS} trials per d_k) with its default options. Not shown: "
          f"{', '.join(in_weights)}, whose temperature lives in the weights of W_Q and W_K rather "
          "than in a rule on q and k"
          + (f"; {', '.join(gated)}, whose output gate σ(x W_g) needs a layer's own input and "
             "weights" if gated else "") + ".")
    return Section(
        name="Saturation at init, every mechanism",
        rows=[dict(r, experiment="saturation_by_mechanism") for r in mech_rows],
        measurements={},
        figures=[("figure_mechanisms_at_init.png", "Max weight (log scale) and entropy vs d_k "
                  "at init for every mechanism whose temperature is a rule on q and k.")],
        markdown=md,
    )
