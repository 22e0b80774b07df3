"""The length study: temperature vs length.  Recall trained at 16 pairs and scored to 512, the
small LM trained at context 128 and scored to 1024, and YaRN's temperature law measured; two
stores (``recall-length`` and ``lm-length``), drawn as tables, claims and four figures.

A record is a sweep record of either store (``{"config", "result", ...}``); seed-to-seed
intervals are the [min, max] over seeds (:mod:`attnscale.study.claims`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from attnscale.experiments.length import lm as lm_length
from attnscale.experiments.length import recall as recall_length
from attnscale.experiments.length.lm import M_GRID, M_STEP, YARN_ALPHA, YARN_BETA
from attnscale.io import json_safe
from attnscale.mechanisms.llama4_temp import llama4_tau
from attnscale.mechanisms.mscale import DEEPSEEK_V2_MSCALE_ALL_DIM, DEEPSEEK_V3_MSCALE_ALL_DIM
from attnscale.mechanisms.yarn import YARN_SLOPE, yarn_m
from attnscale.study import claims as claim_rules
from attnscale.study.registry import register
from attnscale.study.seeds import spread
from attnscale.study.spec import Analysis, Study, Trials

SUMMARY = "length_study.json"
FIGURES = {"recall": "length_recall.png", "lm_loss": "length_lm_loss.png",
           "lm_entropy": "length_lm_entropy.png", "yarn": "length_yarn.png"}
TITLE = "Temperature vs length: recall beyond the trained pair count, and the YaRN law measured"
# Positions per bin in the by-position figures (the curves are per-position means over windows).
POSITION_BIN = 16
COLUMNS = ["quantity", "ours", "ci", "verdict"]


def _order(records: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(r["config"]["mechanism"] for r in records))


def _by_mechanism(records: Sequence[dict], mechanism: str) -> list[dict]:
    return sorted((r for r in records if r["config"]["mechanism"] == mechanism),
                  key=lambda r: r["config"]["seed"])


def recall_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (mechanism, pairs): accuracy, entropy and max weight over seeds (mean, std,
    min, max, n), and ln(pairs), entropy's ceiling."""
    rows = []
    for mech in _order(records):
        runs = _by_mechanism(records, mech)
        for i, n in enumerate(runs[0]["result"]["lengths"]):
            row = {"mechanism": mech, "pairs": n, "log_pairs": math.log(n),
                   "train_pairs": runs[0]["config"]["pairs"], "seeds": len(runs)}
            for stat in ("accuracy", "entropy", "max_weight"):
                row[stat] = spread([r["result"][stat][i] for r in runs])
            rows.append(row)
    return rows


def lm_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (mechanism, context): validation loss over the first ``context`` positions,
    over seeds."""
    rows = []
    for mech in _order(records):
        runs = _by_mechanism(records, mech)
        for i, n in enumerate(runs[0]["result"]["lengths"]):
            rows.append({"mechanism": mech, "context": n, "train_context":
                         runs[0]["config"]["seq_len"], "seeds": len(runs),
                         "loss": spread([r["result"]["loss_at_length"][i] for r in runs])})
    return rows


def pruning_rows(records: Sequence[dict]) -> list[dict]:
    """Selective attention under context pruning: one row per memory factor f (each query keeps
    seq_len / f keys), the validation loss at the trained context over seeds."""
    runs = [r for r in records if r["result"].get("pruning")]
    factors = list(dict.fromkeys(p["memory_factor"] for r in runs for p in r["result"]["pruning"]))
    return [{"memory_factor": f, "context": runs[0]["config"]["seq_len"],
             "budget": next(p["budget"] for p in runs[0]["result"]["pruning"]
                            if p["memory_factor"] == f),
             "loss": spread([p["loss"] for r in runs for p in r["result"]["pruning"]
                             if p["memory_factor"] == f])} for f in factors]


def yarn_rows(records: Sequence[dict]) -> list[dict]:
    """One row per extension factor s: the fitted √(1/t) per seed, its spread, and YaRN's
    0.1 ln s + 1."""
    runs = [r for r in records if r["result"].get("yarn")]
    factors = list(dict.fromkeys(y["factor"] for r in runs for y in r["result"]["yarn"]))
    rows = []
    for s in factors:
        per_seed = [(r["config"]["seed"], y) for r in runs for y in r["result"]["yarn"]
                    if y["factor"] == s]
        fits = [y["fit"]["x"] for _, y in per_seed]
        rows.append({"factor": s, "context": per_seed[0][1]["length"], "yarn": yarn_m(s),
                     "per_seed": fits, "edge": [y["fit"]["edge"] for _, y in per_seed],
                     "loss_at_fit": [y["fit"]["y"] for _, y in per_seed],
                     "loss_at_1": [y["loss"][y["m"].index(1.0)] if 1.0 in y["m"] else None
                                   for _, y in per_seed],
                     "fit": spread(fits)})
    return rows


def mscale_rows(records: Sequence[dict]) -> list[dict]:
    """One row per extension factor s from the ``mscale`` trials (each the scaled model of its
    seed, extended with YaRN's frequencies): the loss at context 128·s under DeepSeek-V2's
    softmax scale (mscale_all_dim 0.707) and under DeepSeek-V3's (1, YaRN's own rule), per seed,
    and their per-seed difference (V2 minus YaRN's)."""
    runs = [r for r in records if r["result"].get("mscale")]
    rows = []
    for s in dict.fromkeys(e["factor"] for r in runs for e in r["result"]["mscale"]):
        def at(r: dict, a: float) -> dict:
            return next(e for e in r["result"]["mscale"]
                        if e["factor"] == s and e["mscale_all_dim"] == a)
        v2 = [at(r, DEEPSEEK_V2_MSCALE_ALL_DIM) for r in runs]
        yarn = [at(r, DEEPSEEK_V3_MSCALE_ALL_DIM) for r in runs]
        rows.append({"factor": s, "context": v2[0]["length"], "m_deepseek_v2": v2[0]["m"],
                     "m_yarn": yarn[0]["m"], "loss_deepseek_v2": spread([e["loss"] for e in v2]),
                     "loss_yarn": spread([e["loss"] for e in yarn]),
                     "difference": spread([a["loss"] - b["loss"] for a, b in zip(v2, yarn)])})
    return rows


def yarn_slope(records: Sequence[dict]) -> dict | None:
    """d√(1/t)/d ln s: per seed the least-squares slope of the fitted √(1/t) against ln s
    (YaRN's law has 0.1), with its spread over seeds and the ln s span; None with < 2 factors."""
    per_seed = []
    for r in records:
        fits = [(math.log(y["factor"]), y["fit"]["x"]) for y in r["result"].get("yarn") or []
                if y["fit"]["x"] is not None]
        if len(fits) >= 2:
            per_seed.append(_slope(fits))
            span = max(x for x, _ in fits) - min(x for x, _ in fits)
    return {"per_seed": per_seed, "span": span, **spread(per_seed)} if per_seed else None


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of y on x, Σ(x - x̄)(y - ȳ) / Σ(x - x̄)², in exactly rounded sums
    (math.fsum): the same bits on every CPU, where a LAPACK fit (numpy.polyfit) differs in the
    last digits between BLAS builds and the shipped pages would not redraw byte for byte."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    x_mean, y_mean = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    return (math.fsum((x - x_mean) * (y - y_mean) for x, y in points)
            / math.fsum((x - x_mean) ** 2 for x in xs))


_interval = claim_rules.interval
# The stick-breaking paper's claim (Tan et al. 2024, arXiv 2410.17980).
STICK_BREAKING_SOURCE = ("Tan et al. 2024: stick-breaking generalises in length (trained at "
                         "2^11 tokens, used at 2^14)")


def _text(s: dict, digits: int = 3) -> str:
    return claim_rules.range_text(s, f"{{:.{digits}f}}")


def _pair_claim(quantity: str, expected_side: str, ours: dict, ref: dict, ref_name: str,
                source: str, note: str) -> dict | None:
    """A claim that ``ours`` lies ``expected_side`` ("lower"/"higher") than ``ref``; None when
    either has no finite value (every seed diverged)."""
    if ours["mean"] is None or ref["mean"] is None:
        return None
    verdict, agrees = claim_rules.verdict([claim_rules.compare(ours, ref)], expected_side)
    return claim_rules.claim(
        quantity, f"{expected_side} than {ref_name}'s {_text(ref)} ({source})", ours["mean"],
        _interval(ours), verdict, agrees,
        f"{note}; {ours['n']} seed(s), interval = seed-to-seed [min, max]")


def _pruning_claim(lm: Sequence[dict], cell: Mapping, train: int) -> dict | None:
    """Selective attention's claim: at the most pruned budget measured, its loss is not above
    scaled's with the whole context (the paper: the same perplexity with 16x-47x less attention
    memory at contexts 512-2048); None without its runs."""
    rows = pruning_rows(lm)
    if not rows or ("scaled", train) not in cell:
        return None
    most = max(rows, key=lambda r: r["memory_factor"])
    ours, ref = most["loss"], cell["scaled", train]["loss"]
    if ours["mean"] is None or ref["mean"] is None:
        return None
    outcome = claim_rules.compare(ours, ref)
    agrees = outcome != "higher"
    verdict = claim_rules.AGREES if agrees else "differs: a higher loss than scaled's"
    full = next((r for r in rows if r["memory_factor"] == 1), None)
    return claim_rules.claim(
        f"small-LM validation loss at context {train} with {most['memory_factor']}x less "
        f"attention memory (each query keeps {most['budget']} keys): selective vs scaled with "
        "every key (nats/byte)",
        f"not higher than scaled's {_text(ref)} (Leviathan et al. 2024, arXiv 2410.02703: equal "
        "perplexity with 16x / 25x / 47x less memory at context 512 / 1024 / 2048)",
        ours["mean"], _interval(ours), verdict, agrees,
        f"{ours['n']} seed(s); agrees when selective's seed range is lower than or overlaps "
        f"scaled's; selective without pruning: "
        f"{_text(full['loss']) if full else 'n/a'}; pruning per query (a key may return), at "
        f"a context {max(1, 512 // train)}x shorter than the paper's shortest")


def claims(recall: Sequence[dict], lm: Sequence[dict]) -> list[dict]:
    """The claim rows (fragment.json's contract); a claim whose runs are missing is left out."""
    out = []
    rows = recall_rows(recall) if recall else []
    if rows:
        longest = max(r["pairs"] for r in rows)
        train = rows[0]["train_pairs"]
        cell = {(r["mechanism"], r["pairs"]): r for r in rows}
        for mech, source in (("ssmax", "Nakanishi 2025: s·ln n generalises to more keys than "
                                       "a fixed temperature"),
                             ("llama4-temp", "Llama 4's temperature tuning, the same argument"),
                             ("stick-breaking", STICK_BREAKING_SOURCE),
                             ("forgetting", "Lin et al. 2025 (FoX, arXiv 2503.02130): a "
                                            "data-dependent forget gate generalises in length")):
            if (mech, longest) in cell and ("scaled", longest) in cell:
                out.append(_pair_claim(
                    f"recall accuracy at {longest} pairs, trained at {train}: {mech} vs scaled",
                    "higher", cell[mech, longest]["accuracy"], cell["scaled", longest]["accuracy"],
                    "scaled", source,
                    f"{mech} at {train} pairs: {_text(cell[mech, train]['accuracy'])}; scaled: "
                    f"{_text(cell['scaled', train]['accuracy'])}"))
    lrows = lm_rows(lm) if lm else []
    if lrows:
        longest = max(r["context"] for r in lrows)
        train = lrows[0]["train_context"]
        cell = {(r["mechanism"], r["context"]): r for r in lrows}
        for mech, source in (("ssmax", "a length-aware temperature extrapolates better"),
                             ("llama4-temp", "a length-aware temperature extrapolates better"),
                             ("stick-breaking", STICK_BREAKING_SOURCE),
                             ("forgetting", "Lin et al. 2025 (FoX, arXiv 2503.02130): lower "
                                            "loss beyond the trained context, without RoPE")):
            if (mech, longest) in cell and ("scaled", longest) in cell:
                out.append(_pair_claim(
                    f"small-LM validation loss at context {longest}, trained at {train}: "
                    f"{mech} vs scaled (nats/byte)", "lower", cell[mech, longest]["loss"],
                    cell["scaled", longest]["loss"], "scaled", source,
                    f"at {train}: {mech} {_text(cell[mech, train]['loss'])}, scaled "
                    f"{_text(cell['scaled', train]['loss'])}"))
        if ("forgetting", train) in cell and ("scaled", train) in cell:
            out.append(_pair_claim(
                f"small-LM validation loss at the trained context {train}: forgetting (no "
                "positional encoding) vs scaled (RoPE), equal size (nats/byte)", "lower",
                cell["forgetting", train]["loss"], cell["scaled", train]["loss"], "scaled",
                "Lin et al. 2025 (FoX): lower loss than the RoPE Transformer at equal size",
                "both trained alike; FoX has W_f (d_model x H + H) more parameters per layer"))
        out.append(_pruning_claim(lm, cell, train))
    out = [c for c in out if c is not None]
    yrows = yarn_rows(lm) if lm else []
    for row in yrows:
        fit = row["fit"]
        if fit["mean"] is None:
            continue
        lo, hi = fit["min"] - M_STEP / 2, fit["max"] + M_STEP / 2
        edge = claim_rules.search_inconclusive(
            [x for x in row["per_seed"] if x is not None], row["edge"], M_GRID)
        agrees = edge is None and lo <= row["yarn"] <= hi
        verdict = edge or ("agrees" if agrees else
                           f"differs: ours is {claim_rules.side(fit['mean'], row['yarn'])}")
        out.append(claim_rules.claim(
            f"YaRN √(1/t) minimising the loss at context {row['context']} "
            f"(s = {row['factor']}), scaled small LM",
            f"{YARN_SLOPE:g}·ln s + 1 = {row['yarn']:.3f} (Peng et al. 2023, fitted on LLaMA "
            "7B-65B)", fit["mean"], _interval(fit), verdict, agrees,
            f"{fit['n']} seed(s); agrees when 0.1·ln s + 1 lies in the seed range widened by "
            f"half the grid step ({M_STEP / 2:g})"
            + ("; a fit sits at the grid's edge" if any(row["edge"]) else "")))
    slope = yarn_slope(lm) if lm else None
    if slope is not None:
        tol = M_STEP / 2 / slope["span"]
        # A slope through a fit at the grid's edge inherits its doubt.
        edge = next((claim_rules.search_inconclusive([], row["edge"], M_GRID) for row in yrows
                     if any(row["edge"])), None)
        agrees = edge is None and slope["min"] - tol <= YARN_SLOPE <= slope["max"] + tol
        side = "lower" if slope["max"] + tol < YARN_SLOPE else "higher"
        out.append(claim_rules.claim(
            "slope of the fitted √(1/t) against ln s, scaled small LM",
            f"{YARN_SLOPE:g} (YaRN's 0.1·ln s + 1)", slope["mean"], _interval(slope),
            edge or ("agrees" if agrees else f"differs: ours is {side}"), agrees,
            f"{slope['n']} seed(s); agrees when {YARN_SLOPE:g} lies in the seed range "
            f"widened by half a grid step over the ln s span ({tol:.3f})"))
    if lm and mscale_rows(lm):
        out += _mscale_claims(lm, slope)
    return json_safe(out)


def _mscale_claims(lm: Sequence[dict], slope: dict | None) -> list[dict]:
    """DeepSeek's mscale against YaRN's rule: per factor, the loss of one model under each (the
    mscale trials); and the fitted coefficient of the scaled sweep, slope / 0.1, against
    DeepSeek-V2's mscale_all_dim."""
    out = []
    zero = {"mean": 0.0, "min": 0.0, "max": 0.0, "n": 1}
    a = DEEPSEEK_V2_MSCALE_ALL_DIM
    for row in mscale_rows(lm):
        diff = row["difference"]
        if diff["mean"] is None:
            continue
        verdict, agrees = claim_rules.verdict([claim_rules.compare(diff, zero)], "lower")
        out.append(claim_rules.claim(
            f"small-LM loss at context {row['context']} (s = {row['factor']}, YaRN's "
            f"frequencies): DeepSeek-V2's mscale (m = {row['m_deepseek_v2']:.3f}) minus YaRN's "
            f"0.1·ln s + 1 (m = {row['m_yarn']:.3f}), nats/byte",
            f"below 0 (DeepSeek-V2 chose mscale_all_dim {a:g} over YaRN's 1)", diff["mean"],
            _interval(diff), verdict, agrees,
            f"{diff['n']} seed(s), one trained model per seed under both rules; the verdict "
            "needs every seed's difference on one side"))
    if slope is not None:
        tol = M_STEP / 2 / slope["span"] / YARN_SLOPE
        fitted = {k: (v / YARN_SLOPE if k in ("mean", "min", "max") else v)
                  for k, v in slope.items() if k != "per_seed"}
        agrees = fitted["min"] - tol <= a <= fitted["max"] + tol
        out.append(claim_rules.claim(
            "fitted mscale_all_dim (slope of the fitted √(1/t) against ln s, over 0.1), scaled "
            "small LM", f"{a:g} (DeepSeek-V2; DeepSeek-V3 ships {DEEPSEEK_V3_MSCALE_ALL_DIM:g}, "
            "YaRN's rule)", fitted["mean"], _interval(fitted),
            "agrees" if agrees else
            f"differs: ours is {claim_rules.side(fitted['mean'], a)}", agrees,
            f"{fitted['n']} seed(s); agrees when {a:g} lies in the seed range widened by half a "
            f"grid step over the ln s span ({tol:.3f})"))
    return out


# --- figures --------------------------------------------------------------------------------------

def _band(ax, x, spreads, name: str) -> None:
    from attnscale.styles import style
    st = style(name)
    ax.plot(x, [s["mean"] for s in spreads], label=name, ms=4, **st)
    if any(s["n"] > 1 for s in spreads):
        ax.fill_between(x, [s["min"] for s in spreads], [s["max"] for s in spreads],
                        color=st["color"], alpha=0.15, lw=0)


def figure_recall(records: Sequence[dict]):
    """Accuracy and attention entropy vs pairs, per mechanism (band: seed range); the trained
    pair count dotted, ln n dashed."""
    from attnscale.plotting import new_figure
    rows = recall_rows(records)
    fig, (acc, ent) = new_figure(2, width=4.6, height=3.6)
    for mech in _order(records):
        rs = [r for r in rows if r["mechanism"] == mech]
        x = [r["pairs"] for r in rs]
        _band(acc, x, [r["accuracy"] for r in rs], mech)
        _band(ent, x, [r["entropy"] for r in rs], mech)
    pairs = sorted({r["pairs"] for r in rows})
    ent.plot(pairs, [math.log(n) for n in pairs], "k--", lw=1, label="ln n (uniform)")
    for ax, label in ((acc, "held-out accuracy"), (ent, "attention entropy (nats)")):
        ax.axvline(rows[0]["train_pairs"], color="gray", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pairs n (trained at the dotted line)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    acc.legend(fontsize=7)
    return fig


def _binned(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(values, dtype=np.float64)
    n = len(v) // POSITION_BIN * POSITION_BIN
    return (np.arange(n // POSITION_BIN) + 0.5) * POSITION_BIN, \
        v[:n].reshape(-1, POSITION_BIN).mean(1)


def _by_position(ax, records: Sequence[dict], curve) -> None:
    from attnscale.styles import style
    for mech in _order(records):
        curves = [np.asarray(curve(r), dtype=np.float64) for r in _by_mechanism(records, mech)
                  if r["result"].get("loss_by_position") is not None]
        if not curves:
            continue
        x, y = _binned(np.mean(curves, axis=0))  # a None (diverged) value shows as a gap
        ax.plot(x, y, label=mech, markevery=0.1, ms=4, **style(mech))
    ax.axvline(records[0]["config"]["seq_len"], color="gray", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"position (mean over bins of {POSITION_BIN}; trained up to the dotted line)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def figure_lm_loss(records: Sequence[dict]):
    """Validation loss vs position, per mechanism, mean over seeds."""
    from attnscale.plotting import new_figure
    fig, (ax,) = new_figure(1, width=6.0, height=3.8)
    _by_position(ax, records, lambda r: r["result"]["loss_by_position"])
    ax.set_ylabel("validation loss (nats/byte)")
    return fig


def figure_lm_entropy(records: Sequence[dict]):
    """Attention entropy vs position (mean over layers, heads, windows and seeds); ln(i + 1),
    the uniform ceiling, dashed."""
    from attnscale.plotting import new_figure
    fig, (ax,) = new_figure(1, width=6.0, height=3.8)
    _by_position(ax, records, lambda r: np.mean(np.asarray(
        r["result"]["entropy_by_position"], dtype=np.float64), axis=0))
    n = len(records[0]["result"]["loss_by_position"])
    x, y = _binned(np.log(np.arange(1, n + 1)))
    ax.plot(x, y, "k--", lw=1, label="ln(i + 1) (uniform)")
    ax.legend(fontsize=7)
    ax.set_ylabel("attention entropy (nats)")
    return fig


def figure_yarn(records: Sequence[dict]):
    """Loss at context 128·s vs the multiplier √(1/t), one panel per s: mean over seeds, the
    fitted minimum (solid) and YaRN's 0.1 ln s + 1 (dashed)."""
    from attnscale.plotting import new_figure
    from attnscale.styles import style
    runs = [r for r in records if r["result"].get("yarn")]
    rows = yarn_rows(records)
    fig, axes = new_figure(max(1, len(rows)), width=3.6, height=3.3)
    for ax, row in zip(axes, rows):
        curves = [y for r in runs for y in r["result"]["yarn"] if y["factor"] == row["factor"]]
        m = curves[0]["m"]
        ax.plot(m, np.mean([c["loss"] for c in curves], axis=0), ms=3, **style("scaled"))
        if row["fit"]["mean"] is not None:
            ax.axvline(row["fit"]["mean"], color="k", lw=1, label="fitted")
        ax.axvline(row["yarn"], color="k", ls="--", lw=1, label="0.1 ln s + 1")
        ax.set_title(f"s = {row['factor']} (context {row['context']})", fontsize=9)
        ax.set_xlabel("√(1/t): logits × (√(1/t))²")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("validation loss (nats/byte)")
    axes[0].legend(fontsize=7)
    return fig


# --- report fragment ------------------------------------------------------------------------------

def _recall_setup(records: Sequence[dict]) -> str:
    c = records[0]["config"]
    seeds = len({r["config"]["seed"] for r in records})
    lengths = records[0]["result"]["lengths"]
    lo, hi = min(lengths), max(lengths)
    fs = c["floor_scale"] if c["floor_scale"] is not None else c["pairs"]
    return (f"Recall (the essay's task, one head, d_k = {c['d_k']}, d_model = {c['d_model']}, "
            f"{c['n_keys']} keys, {c['n_values']} values) trained at {c['pairs']} pairs for "
            f"{c['steps']} steps of batch {c['batch_size']}, then scored on {c['eval_size']} "
            f"held-out sequences per pair count with no retraining; {seeds} seed(s). "
            f"llama4-temp uses floor_scale = {fs:g} (the trained pair count, as Llama 4's 8192 "
            f"is its chunked layers' span), so τ = 0.1·ln(1 + ⌊n/{fs:g}⌋) + 1 goes from "
            f"{llama4_tau(lo, fs):.2f} to {llama4_tau(hi, fs):.2f} over the evaluated counts.")


def _lm_setup(records: Sequence[dict]) -> str:
    c = records[0]["config"]
    seeds = len({r["config"]["seed"] for r in records})
    return (f"The small byte-level LM (width {c['d_model']}, {c['n_layers']} layers, "
            f"{c['n_heads']} heads, RoPE) trained at context {c['seq_len']} for {c['steps']} "
            f"steps, {seeds} seed(s); evaluated with no fine-tuning on {c['eval_windows']} "
            "validation windows, the loss at context L being the mean over the first L positions "
            "(causal, so equal to scoring windows of length L).  llama4-temp uses floor_scale = "
            f"{c['seq_len']}.  YaRN: the scaled model's RoPE frequencies are interpolated by "
            f"NTK-by-parts (α = {YARN_ALPHA:g}, β = {YARN_BETA:g}) for context "
            f"{c['seq_len']}·s, and the multiplier √(1/t) on q and k swept over "
            f"{M_GRID[0]:.2f}-{M_GRID[-1]:.2f} in steps of {M_STEP:g}; the minimum is the vertex "
            "of a parabola through the grid minimum and its neighbours."
            + ("  stick-breaking runs without RoPE: its weights carry the order of the keys "
               "(Tan et al. 2024)." if any(r["config"]["mechanism"] == "stick-breaking"
                                           for r in records) else ""))


def _table(names: Sequence[str], heads: Sequence, cell, label=str) -> list[str]:
    """A markdown table: one row per name, one column per head, ``cell(name, head)`` text."""
    return (["| mechanism | " + " | ".join(label(h) for h in heads) + " |",
             "|---|" + "---|" * len(heads)]
            + [f"| {name} | " + " | ".join(cell(name, h) for h in heads) + " |"
               for name in names])


def markdown(recall: Sequence[dict], lm: Sequence[dict], claim_rows: Sequence[dict]) -> str:
    lines = []
    if recall:
        rows = recall_rows(recall)
        pairs = sorted({r["pairs"] for r in rows})
        cell = {(r["mechanism"], r["pairs"]): r for r in rows}
        lines += ["#### Recall beyond the trained pair count", "", _recall_setup(recall), "",
                  "Held-out accuracy, mean [seed min, max]:", "",
                  *_table(_order(recall), pairs, lambda m, n: _text(cell[m, n]["accuracy"], 2),
                          lambda n: f"{n} pairs"),
                  "", "Attention entropy (nats), mean over seeds; ln n is the uniform ceiling:",
                  "", *_table(["ln n", *_order(recall)], pairs,
                              lambda m, n: f"{math.log(n):.2f}" if m == "ln n" else
                              f"{cell[m, n]['entropy']['mean']:.2f}"),
                  "", f"![accuracy and entropy vs pairs]({FIGURES['recall']})", ""]
    if lm:
        rows = lm_rows(lm)
        ctx = sorted({r["context"] for r in rows})
        cell = {(r["mechanism"], r["context"]): r for r in rows}
        lines += ["#### Small-LM length extrapolation", "", _lm_setup(lm), "",
                  "Validation loss (nats/byte) at each context, mean [seed min, max]:", "",
                  *_table(_order(lm), ctx, lambda m, n: _text(cell[m, n]["loss"]))]
        lines += ["", f"![loss vs position]({FIGURES['lm_loss']})", "",
                  f"![attention entropy vs position]({FIGURES['lm_entropy']})", ""]
        yrows = yarn_rows(lm)
        if yrows:
            lines += ["#### YaRN's temperature law", "",
                      "Validation loss (nats/byte) at context 128·s: with YaRN's interpolation "
                      "at the fitted √(1/t) and at 1, and plain RoPE with no interpolation.", "",
                      "| s | context | fitted √(1/t) | 0.1·ln s + 1 | loss at fit | loss at 1 "
                      "| plain RoPE |", "|---|---|---|---|---|---|---|"]
            for r in yrows:
                at_fit = spread(r["loss_at_fit"])
                at_1 = spread([v for v in r["loss_at_1"] if v is not None])
                plain = cell.get(("scaled", r["context"]))
                lines.append(f"| {r['factor']} | {r['context']} | {_text(r['fit'])} | "
                             f"{r['yarn']:.3f} | {_text(at_fit)} | {_text(at_1)} | "
                             f"{_text(plain['loss']) if plain else 'n/a'} |")
            lines += ["", f"![loss vs the YaRN multiplier]({FIGURES['yarn']})", ""]
        mrows = mscale_rows(lm)
        if mrows:
            lines += ["#### DeepSeek's mscale against YaRN's rule", "",
                      "DeepSeek-V2 and V3 multiply the softmax scale by mscale², mscale = "
                      "0.1·mscale_all_dim·ln s + 1 (mechanism `mscale`), where YaRN multiplies q "
                      f"and k by 0.1·ln s + 1: the same rule at DeepSeek-V3's mscale_all_dim = "
                      f"{DEEPSEEK_V3_MSCALE_ALL_DIM:g}, a gentler one at DeepSeek-V2's "
                      f"{DEEPSEEK_V2_MSCALE_ALL_DIM:g}.  The mscale runs train the scaled model "
                      "(factor 1 leaves its logits alone) and extend it with YaRN's frequencies "
                      "under each rule.  Validation loss (nats/byte) at context 128·s, mean "
                      "[seed min, max]:", "",
                      "| s | context | m, DeepSeek-V2 | m, YaRN | loss, DeepSeek-V2 | loss, YaRN "
                      "| difference |", "|---|---|---|---|---|---|---|"]
            for r in mrows:
                lines.append(f"| {r['factor']} | {r['context']} | {r['m_deepseek_v2']:.3f} | "
                             f"{r['m_yarn']:.3f} | {_text(r['loss_deepseek_v2'])} | "
                             f"{_text(r['loss_yarn'])} | {_text(r['difference'])} |")
            lines.append("")
        prows = pruning_rows(lm)
        if prows:
            lines += ["#### Selective attention with less memory", "",
                      "Validation loss (nats/byte) at the trained context when each query keeps "
                      "only the keys selected least (context pruning, Leviathan et al. 2024):", "",
                      "| memory factor | keys kept per query | loss |", "|---|---|---|"]
            lines += [f"| {r['memory_factor']}x | {r['budget']} | {_text(r['loss'])} |"
                      for r in prows]
            lines += [""]
    lines += ["#### Claims", "", "| claim | expected | ours | verdict |", "|---|---|---|---|"]
    for c in claim_rows:  # from claims(recall, lm)
        ours = "n/a" if c["ours"] is None else f"{c['ours']:.3f}"
        if c["ci"] is not None and c["ci"][0] != c["ci"][1]:
            ours += f" [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}]"
        lines.append(f"| {c['quantity']} | {c['expected']} | {ours} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def analyse(stores: Mapping[str, list[dict]]) -> Analysis:
    """The tables, claims and figures of the sections that have runs."""
    recall, lm = stores["recall-length"], stores["lm-length"]
    found = claims(recall, lm)
    tables = {"recall": recall_rows(recall) if recall else [],
              "lm": lm_rows(lm) if lm else [], "yarn": yarn_rows(lm) if lm else [],
              "yarn_slope": yarn_slope(lm) if lm else None, "claims": found}
    if lm and mscale_rows(lm):  # DeepSeek's rule, once the store holds mscale runs
        tables["mscale"] = mscale_rows(lm)
    if lm and pruning_rows(lm):  # selective attention's runs (a store without them: no key)
        tables["pruning"] = pruning_rows(lm)
    figures = {}
    if recall:
        figures[FIGURES["recall"]] = lambda: figure_recall(recall)
    if lm:
        figures[FIGURES["lm_loss"]] = lambda: figure_lm_loss(lm)
        figures[FIGURES["lm_entropy"]] = lambda: figure_lm_entropy(lm)
        if tables["yarn"]:
            figures[FIGURES["yarn"]] = lambda: figure_yarn(lm)
    return Analysis(markdown(recall, lm, found), found, tables, figures, table=found,
                    columns=COLUMNS)


# The full study: the recall mechanisms (recall_length.MECHANISMS) x 3 seeds at the essay's
# widths and the length config's 1200 steps; the LM (width 64, 2 layers) at 2000 steps, its
# mechanisms (lm_length.MECHANISMS) x 3 seeds.  --quick (about 10 minutes on 2 cores as
# measured with fewer mechanisms; it grows with their count): 2 seeds; recall at width 64,
# 600 steps, 500 held-out sequences per length; the LM at 600 steps on 16 windows.
STUDY = register(Study(
    name="length",
    title=TITLE,
    doc="Temperature vs length: recall trained at 16 pairs and scored to 512 pairs, the small "
        "LM trained at context 128 and scored to 1024, and YaRN's temperature law "
        "0.1·ln s + 1 measured on the scaled LM.",
    stores={"recall-length": Trials("recall-length", {"mechanism": recall_length.MECHANISMS,
                                                      "seed": (0, 1, 2)}),
            "lm-length": Trials("lm-length", {"mechanism": lm_length.MECHANISMS,
                                              "seed": (0, 1, 2)})},
    quick={"recall-length": Trials("recall-length", {"mechanism": recall_length.MECHANISMS,
                                                     "seed": (0, 1)},
                                   {"d_k": 64, "d_model": 64, "steps": 600, "eval_size": 500}),
           "lm-length": Trials("lm-length", {"mechanism": lm_length.MECHANISMS, "seed": (0, 1)},
                               {"steps": 600, "eval_windows": 16})},
    quick_doc="2 seeds, fewer steps, recall at width 64: about 10 minutes on 2 cores",
    analyse=analyse, summary=SUMMARY, figures=tuple(FIGURES.values()),
    page_figures={FIGURES["recall"]: "recall accuracy vs pairs",
                  FIGURES["lm_loss"]: "LM loss vs context"},
    examples="""
  attnscale reproduce --out report/ --include length/
""",
))
