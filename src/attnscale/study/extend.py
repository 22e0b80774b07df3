"""The extension study: a pretrained checkpoint run at s times its trained context L, training-free,
under each temperature treatment (:mod:`attnscale.experiments.extend`), and YaRN's temperature
rule √(1/t) = 0.1 ln s + 1 measured on it.  One ``extend`` store; ``attnscale study extension``
(or ``attnscale extend``) runs, resumes and redraws it.

Intervals are over the text's non-overlapping windows (each window one sample of the loss): the
mean ± t₀.₉₇₅(n − 1) standard errors (:func:`attnscale.stats.t975`), none for one window.  The
best attention factor a* of a window is the vertex of the parabola through the lowest loss of
``hf-yarn``'s attention-factor grid and its two neighbours
(:func:`attnscale.experiments.length.lm.fit_minimum`), the loss being the mean over the whole
window of s·L tokens (the perplexity at context s·L, as the YaRN paper fits it).  a = √(1/t):
transformers multiplies q and k by a, so the logits are qᵀk / (t √d).  The slope of a* against
ln s is fitted per window through YaRN's anchor a(1) = 1 (no extension, no temperature),
b = Σ ln s (a* − 1) / Σ (ln s)², against YaRN's 0.1.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import numpy as np

from attnscale.experiments.extend import (
    ATTENTION_FACTOR, HF_YARN, LENGTH_MECHANISMS, NATIVE, parse_treatment,
)
from attnscale.mechanisms.yarn import YARN_SLOPE, yarn_m
from attnscale.study import claims as claim_rules
from attnscale.study.registry import register
from attnscale.study.spec import Analysis, Option, Study, Trials

SUMMARY = "extension.json"
FIGURES = {"loss": "extension_loss.png", "factor": "extension_factor.png"}
TITLE = "Past the trained context: which temperature holds a pretrained checkpoint at s x L"
COLUMNS = ["quantity", "ours", "ci", "verdict"]
# The attention factors a swept with transformers' YaRN, around its default 0.1 ln s + 1
# (1.069 at s = 2, 1.139 at s = 4): from none (1) to well past the rule.
ATTENTION_FACTORS = (1.0, 1.1, 1.2, 1.35)
# The study's default treatments: the model as it is, transformers' YaRN at its default factor
# and over the grid, and the length-aware mechanisms at their defaults (length options tied to
# the checkpoint) and at a second strength.
TREATMENTS = (NATIVE, HF_YARN,
              *(f"{HF_YARN}({ATTENTION_FACTOR}={a})" for a in ATTENTION_FACTORS),
              *LENGTH_MECHANISMS,
              "llama4-temp(attn_scale=0.2)", "mscale(mscale_all_dim=0.707)")
FACTORS = (2.0,)
WINDOWS = (0, 1, 2)


# --- intervals over windows -------------------------------------------------------------------

def over_windows(values: Sequence[float]) -> dict:
    """Mean, standard error, 95% t-interval and n of one value per window (no interval for one
    window, or when a value is missing)."""
    from attnscale.stats import t975
    got = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(got)
    if not n:
        return {"mean": None, "se": None, "ci": None, "n": 0}
    mean = math.fsum(got) / n
    if n < 2:
        return {"mean": mean, "se": None, "ci": None, "n": n}
    se = math.sqrt(math.fsum((v - mean) ** 2 for v in got) / (n - 1) / n)
    half = t975(n - 1) * se
    return {"mean": mean, "se": se, "ci": [mean - half, mean + half], "n": n}


def _text(s: dict, fmt: str = "{:.3f}") -> str:
    from attnscale.formatting import number, with_interval
    return "n/a" if s["mean"] is None else with_interval(s["mean"], s["ci"], fmt) \
        if s["ci"] else number(s["mean"], fmt)


# --- tables -----------------------------------------------------------------------------------

def _factors(records: Sequence[dict]) -> list[float]:
    return sorted({r["config"]["factor"] for r in records})


def _treatments(records: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(r["config"]["treatment"] for r in records))


def _cell(records: Sequence[dict], factor: float, treatment: str) -> dict[int, dict]:
    """window -> result, for one (s, treatment)."""
    return {r["config"]["window"]: r["result"] for r in records
            if r["config"]["factor"] == factor and r["config"]["treatment"] == treatment}


def check_windows(records: Sequence[dict]) -> None:
    """Every trial of one (s, window) read the same tokens (their hash): a text or tokenizer
    that changed under the store is refused rather than compared."""
    from attnscale.errors import ConfigError
    seen: dict[tuple, str] = {}
    for r in records:
        key = (r["config"]["factor"], r["config"]["window"])
        got = r["result"]["tokens_blake2b"]
        if seen.setdefault(key, got) != got:
            raise ConfigError(f"the extension store's window {key[1]} at s = {key[0]:g} holds "
                              "two different token sequences; its trials cannot be compared.")


def loss_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (s, treatment): the loss over the whole window, the first L positions and the
    positions beyond L, over windows; and its difference from ``hf-yarn`` (YaRN's rule) over the
    windows both ran, paired."""
    rows = []
    for s in _factors(records):
        ref = _cell(records, s, HF_YARN)
        for t in _treatments(records):
            cell = _cell(records, s, t)
            if not cell:
                continue
            first = next(iter(cell.values()))
            windows = sorted(cell)
            paired = [w for w in windows if w in ref]
            rows.append({
                "factor": s, "treatment": t, "windows": windows, "length": first["length"],
                "train_len": first["train_len"],
                "attention_factor": first["attention_factor"],
                "loss": over_windows([cell[w]["loss"] for w in windows]),
                "loss_trained": over_windows([cell[w]["loss_trained"] for w in windows]),
                "loss_beyond": over_windows([cell[w]["loss_beyond"] for w in windows]),
                "beyond_vs_yarn": over_windows([cell[w]["loss_beyond"] - ref[w]["loss_beyond"]
                                                for w in paired]) if t != HF_YARN else None,
            })
    return rows


def _yarn_curves(records: Sequence[dict], s: float) -> dict[int, list[tuple[float, float]]]:
    """window -> [(a, loss over the window)] of every ``hf-yarn`` trial at s, sorted by a."""
    out: dict[int, list] = {}
    for r in records:
        c = r["config"]
        if c["factor"] == s and parse_treatment(c["treatment"]).name == HF_YARN:
            out.setdefault(c["window"], []).append((r["result"]["attention_factor"],
                                                    r["result"]["loss"]))
    return {w: sorted(points) for w, points in out.items()}


def best_rows(records: Sequence[dict]) -> list[dict]:
    """One row per s with at least 3 attention factors: per window the fitted a* (and whether it
    sits at the grid's edge), a* over windows, t = 1/a*², and YaRN's 0.1 ln s + 1."""
    from attnscale.experiments.length.lm import fit_minimum
    rows = []
    for s in _factors(records):
        curves = {w: c for w, c in _yarn_curves(records, s).items() if len(c) >= 3}
        if not curves:
            continue
        fits = {w: fit_minimum([a for a, _ in c], [y for _, y in c]) for w, c in curves.items()}
        grid = sorted({a for c in curves.values() for a, _ in c})
        best = over_windows([f["x"] for f in fits.values()])
        rows.append({"factor": s, "yarn": yarn_m(s), "grid": grid,
                     "per_window": {w: f["x"] for w, f in fits.items()},
                     "edge": [bool(f["edge"]) for f in fits.values()], "best": best,
                     "t": None if best["mean"] is None else 1.0 / best["mean"] ** 2})
    return rows


def slope(records: Sequence[dict]) -> dict | None:
    """d a*/d ln s through a(1) = 1, per window over the factors it has a* at, then over
    windows: ``{"per_window", **over_windows}``; None without a fit."""
    rows = best_rows(records)
    if not rows:
        return None
    per_window = {}
    for w in sorted({w for r in rows for w in r["per_window"]}):
        points = [(math.log(r["factor"]), r["per_window"][w]) for r in rows
                  if r["per_window"].get(w) is not None]
        if points:
            per_window[w] = (math.fsum(x * (a - 1.0) for x, a in points)
                             / math.fsum(x * x for x, _ in points))
    return {"per_window": per_window, "factors": [r["factor"] for r in rows],
            **over_windows(list(per_window.values()))}


# --- claims -----------------------------------------------------------------------------------

YARN_SOURCE = (f"√(1/t) = {YARN_SLOPE:g}·ln s + 1, attention logits divided by t (Peng et al. "
               "2023, arXiv 2309.00071, eq. 22, fitted on LLaMA 7B-65B)")


def _in_interval(value: float, s: dict) -> tuple[str, bool]:
    if s["ci"] is None:
        return "inconclusive: one window, no interval", False
    lo, hi = s["ci"]
    if lo <= value <= hi:
        return claim_rules.AGREES, True
    return f"differs: ours is {claim_rules.side(s['mean'], value)}", False


def claims(records: Sequence[dict]) -> list[dict]:
    """YaRN's rule per s, its slope, and that YaRN holds the loss beyond L where the model as it
    is breaks."""
    out = []
    brows = best_rows(records)
    for row in brows:
        best = row["best"]
        edge = claim_rules.search_inconclusive([], row["edge"], row["grid"])
        verdict, agrees = (edge, False) if edge else _in_interval(row["yarn"], best)
        out.append(claim_rules.claim(
            f"best attention factor √(1/t) at s = {row['factor']:g} (transformers' YaRN, loss "
            "over the whole window)", f"{row['yarn']:.3f}: {YARN_SOURCE}", best["mean"],
            best["ci"], verdict, agrees,
            f"{best['n']} window(s), 95% t-interval over windows; grid "
            f"{', '.join(f'{a:.3f}' for a in row['grid'])}"))
    b = slope(records)
    if b is not None and b["mean"] is not None:
        edge = next((claim_rules.search_inconclusive([], r["edge"], r["grid"]) for r in brows
                     if any(r["edge"])), None)
        verdict, agrees = (edge, False) if edge else _in_interval(YARN_SLOPE, b)
        out.append(claim_rules.claim(
            "slope of √(1/t) against ln s, through √(1/t) = 1 at s = 1",
            f"{YARN_SLOPE:g} ({YARN_SOURCE})", b["mean"], b["ci"], verdict, agrees,
            f"{b['n']} window(s); s = {', '.join(f'{s:g}' for s in b['factors'])}"))
    for row in loss_rows(records):
        if row["treatment"] != NATIVE or row["beyond_vs_yarn"] is None:
            continue
        d = row["beyond_vs_yarn"]
        if d["mean"] is None:
            continue
        agrees = d["ci"] is not None and d["ci"][0] > 0
        verdict = claim_rules.AGREES if agrees else (
            "inconclusive: one window, no interval" if d["ci"] is None else
            "differs: the interval reaches 0 or below")
        out.append(claim_rules.claim(
            f"loss beyond L at s = {row['factor']:g}: the model as it is minus transformers' "
            "YaRN (nats/token)", "above 0: unscaled RoPE breaks past the trained context, "
                                 "YaRN holds it (Peng et al. 2023)", d["mean"], d["ci"],
            verdict, agrees, f"{d['n']} window(s), paired"))
    return out


# --- figures ----------------------------------------------------------------------------------

def figure_loss(records: Sequence[dict]):
    """Loss against position, one panel per s, one line per treatment (mean over windows); the
    trained context L dotted."""
    from attnscale.plotting import new_figure
    from attnscale.styles import style
    factors = _factors(records)
    fig, axes = new_figure(len(factors), width=6.4, height=4.2)
    for ax, s in zip(axes, factors):
        for t in _treatments(records):
            cell = _cell(records, s, t)
            if not cell:
                continue
            first = next(iter(cell.values()))
            y = np.mean([c["loss_by_bucket"] for c in cell.values()], axis=0)
            x = (np.arange(len(y)) + 0.5) * first["bucket"]
            ax.plot(x, y, label=f"{t} ({len(cell)})", lw=1.2, ms=3, markevery=0.1,
                    **style(t))
        ax.axvline(first["train_len"], color="gray", ls=":", lw=1)
        ax.set_title(f"s = {s:g}: {first['length']} tokens (trained to the dotted line)",
                     fontsize=9)
        ax.set_xlabel(f"position (mean over buckets of {first['bucket']})")
        ax.set_ylabel("next-token loss (nats), mean over windows")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, title="treatment (windows)", title_fontsize=6)
    return fig


def figure_factor(records: Sequence[dict]):
    """Left: the loss over the window against transformers' attention factor a, per s (each
    window thin, the fitted a* solid, YaRN's 0.1 ln s + 1 dashed).  Right: a* with its interval
    against ln s, and YaRN's line."""
    from attnscale.plotting import new_figure
    rows = best_rows(records)
    fig, (left, right) = new_figure(2, width=4.6, height=3.8)
    colours = ["C0", "C1", "C2", "C3", "C4"]
    for i, row in enumerate(rows):
        colour = colours[i % len(colours)]
        for w, curve in sorted(_yarn_curves(records, row["factor"]).items()):
            left.plot([a for a, _ in curve], [y for _, y in curve], "-o", color=colour, lw=0.8,
                      ms=3, alpha=0.6, label=f"s = {row['factor']:g}" if w == min(
                          row["per_window"]) else None)
        if row["best"]["mean"] is not None:
            left.axvline(row["best"]["mean"], color=colour, lw=1.2)
        left.axvline(row["yarn"], color=colour, ls="--", lw=1)
        best = row["best"]
        if best["mean"] is not None:
            err = None if best["ci"] is None else [[best["mean"] - best["ci"][0]],
                                                   [best["ci"][1] - best["mean"]]]
            right.errorbar([math.log(row["factor"])], [best["mean"]], yerr=err, fmt="o",
                           color=colour, capsize=3, label=f"a*, s = {row['factor']:g}")
    left.set_xlabel("attention factor a = √(1/t) (logits × a²)")
    left.set_ylabel("loss over the window (nats/token)")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    top = max([math.log(r["factor"]) for r in rows] + [math.log(4)])
    xs = np.linspace(0, top * 1.1, 20)
    right.plot(xs, YARN_SLOPE * xs + 1, "k--", lw=1, label="YaRN: 0.1 ln s + 1")
    right.set_xlabel("ln s")
    right.set_ylabel("best √(1/t)")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=7)
    return fig


# --- the fragment -----------------------------------------------------------------------------

def _setup(records: Sequence[dict]) -> str:
    r0 = records[0]
    c, res = r0["config"], r0["result"]
    # The text the windows read: the last window's source spans every window's tokens.
    last = max(records, key=lambda r: (r["config"]["window"], r["result"]["length"]))
    source = last["result"]["text_source"]
    windows = sorted({r["config"]["window"] for r in records})
    threads = sorted({r["result"]["threads"] for r in records})
    peaks = [r["result"]["peak_rss_bytes"] for r in records
             if r["result"]["peak_rss_bytes"] is not None]
    text = "text that ships with Python" if c["text"] is None else f"the file {c['text']}"
    return (f"Checkpoint `{c['checkpoint'].rsplit('/', 1)[-1]}` ({res['model']}, trained context "
            f"L = {res['train_len']}), evaluated with no training on {len(windows)} "
            f"non-overlapping window(s) of s·L tokens of {text} ({source}).  "
            f"{len(records)} trials complete.  " + _forward_times(records)
            + f" on {'/'.join(map(str, threads))} CPU thread(s), wall time: a forward that shared "
            "the machine with other work took longer"
            + (f"; peak resident memory {max(peaks) / 2**30:.2f} GiB" if peaks else "")
            + ".  Treatments: `native` is the model as it is; "
            "`hf-yarn` is transformers' YaRN RoPE scaling at its default attention factor "
            "a = 0.1 ln s + 1, `hf-yarn(attention_factor=a)` at a; a mechanism runs on the same "
            "YaRN frequencies with a = 1, its length option tied to the checkpoint "
            "(logn's train_len = L, llama4-temp's floor_scale = L, mscale's factor = s, SSMax's "
            "s = 1/ln L unless named).  Intervals: 95% t-intervals over windows.")


def _forward_times(records: Sequence[dict]) -> str:
    """One clause per window length: the fastest forward with the load average before it, and
    the median forward."""
    parts = []
    for n in sorted({r["result"]["length"] for r in records}):
        rows = [r["result"] for r in records if r["result"]["length"] == n]
        best = min(rows, key=lambda r: r["forward_seconds"])
        median = statistics.median(r["forward_seconds"] for r in rows)
        loads = [r["loadavg_before"][0] for r in rows]
        parts.append(f"a forward of {n} tokens took {best['forward_seconds']:.0f} s at best (load "
                     f"average {best['loadavg_before'][0]:.1f} before it) and {median:.0f} s in "
                     f"the median of {len(rows)} (load {min(loads):.1f}-{max(loads):.1f})")
    text = "; ".join(parts)
    return text[:1].upper() + text[1:]


def markdown(records: Sequence[dict], claim_rows: Sequence[dict]) -> str:
    lines = ["#### Setup", "", _setup(records), ""]
    for s in _factors(records):
        rows = [r for r in loss_rows(records) if r["factor"] == s]
        lines += [f"#### s = {s:g} ({rows[0]['length']} tokens)", "",
                  "Next-token loss (nats/token), mean [95% interval] over windows; the last "
                  "column is the loss beyond L minus hf-yarn's, paired by window:", "",
                  "| treatment | windows | a | whole window | first L | beyond L | "
                  "beyond L − hf-yarn |", "|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["loss"]["mean"] is None, r["loss"]["mean"])):
            diff = "" if r["beyond_vs_yarn"] is None else _text(r["beyond_vs_yarn"])
            lines.append(f"| {r['treatment']} | {len(r['windows'])} | "
                         f"{r['attention_factor']:.3f} | {_text(r['loss'])} | "
                         f"{_text(r['loss_trained'])} | {_text(r['loss_beyond'])} | {diff} |")
        lines.append("")
    lines += [f"![loss against position]({FIGURES['loss']})", ""]
    brows = best_rows(records)
    if brows:
        lines += ["#### YaRN's rule measured", "",
                  "The attention factor a = √(1/t) minimising the loss over the window, fitted "
                  "per window, against YaRN's 0.1 ln s + 1 (t: the attention logits are divided "
                  "by t, as in the YaRN paper):", "",
                  "| s | best √(1/t) | t = 1/a*² | 0.1 ln s + 1 | per window |",
                  "|---|---|---|---|---|"]
        for r in brows:
            per = ", ".join(f"{a:.3f}" + (" (edge)" if e else "") for a, e in
                            zip(r["per_window"].values(), r["edge"]))
            lines.append(f"| {r['factor']:g} | {_text(r['best'])} | "
                         f"{'n/a' if r['t'] is None else format(r['t'], '.3f')} | "
                         f"{r['yarn']:.3f} | {per} |")
        b = slope(records)
        if b is not None:
            lines += ["", f"Slope of √(1/t) against ln s through 1 at s = 1: {_text(b)} "
                          f"({b['n']} window(s)), YaRN's {YARN_SLOPE:g}."]
        lines += ["", f"![the best attention factor against YaRN's rule]({FIGURES['factor']})",
                  ""]
    lines += ["#### Claims", "", "| claim | expected | ours | verdict |", "|---|---|---|---|"]
    for c in claim_rows:
        from attnscale.formatting import with_interval
        ours = "n/a" if c["ours"] is None else with_interval(c["ours"], c["ci"], "{:.3f}")
        lines.append(f"| {c['quantity']} | {c['expected']} | {ours} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def analyse(stores: Mapping[str, list[dict]]) -> Analysis:
    """The tables, claims and figures of the store's finished trials."""
    records = stores["extend"]
    check_windows(records)
    found = claims(records)
    tables = {"losses": loss_rows(records), "best": best_rows(records),
              "slope": slope(records), "claims": found, "trials": len(records)}
    figures = {FIGURES["loss"]: lambda: figure_loss(records)}
    if tables["best"]:
        figures[FIGURES["factor"]] = lambda: figure_factor(records)
    return Analysis(markdown(records, found), found, tables, figures, table=found,
                    columns=COLUMNS)


def page_section(folder) -> list[str]:
    """The results page's lines for the extension study in ``folder`` (nothing when it holds no
    store): how many trials are complete, and each claim's verdict, read from the store."""
    from pathlib import Path
    from attnscale.sweep.store import Store
    folder = Path(folder)
    if not Store(folder).exists():
        return []
    from attnscale import sweep
    res = sweep.load(folder)
    total = len(res.ok) + len(res.failed) + len(res.pending)
    page = f"{folder.name}/fragment.md"
    lines = ["## Past the trained context", "",
             (f"[{page}]({page})" if (folder / "fragment.md").is_file() else folder.name)
             + " (`attnscale study extension`): a pretrained checkpoint at s times its trained context under each "
             f"temperature treatment, and YaRN's rule √(1/t) = 0.1 ln s + 1 measured on it; "
             f"{len(res.ok)} of {total} trials complete"
             + (f" (resume with `attnscale study extension --resume {folder.name}`)"
                if len(res.ok) < total else "") + ".", ""]
    settings = Store(folder).read_spec().settings()
    seconds = [r["result"]["forward_seconds"] for r in res.ok]
    lines[-2] += (f"  The grid, {len(settings['window'])} window(s) x "
                  f"{len(settings['treatment'])} treatment(s) at s = "
                  f"{', '.join(f'{s:g}' for s in settings['factor'])}"
                  ", is sized to the machine: "
                  + (f"one forward took {min(seconds) / 60:.0f} min at best and "
                     f"{statistics.median(seconds) / 60:.0f} in the median on a shared 2-core "
                     "CPU; " if seconds else "")
                  + f"`attnscale sweep --resume {folder.name} --grid window=0,1,2,3 --extend` "
                  "adds windows.")
    if res.ok:
        from attnscale.formatting import with_interval
        for c in claims(list(res.ok)):
            ours = "n/a" if c["ours"] is None else with_interval(c["ours"], c["ci"], "{:.3f}")
            lines.append(f"- **{c['quantity']}**: {c['verdict']}. Expected: {c['expected']}. "
                         f"Measured: {ours}; {c['note']}.")
        lines.append("")
    return lines


def _check_treatment(text: str) -> str:
    return parse_treatment(text, param="--treatments").text


STUDY = register(Study(
    name="extension",
    title=TITLE,
    doc="A pretrained checkpoint (a save_pretrained folder or a .gguf) at s times its trained "
        "context, training-free, under each temperature treatment (unscaled, transformers' "
        "YaRN over an attention-factor grid, logn, ssmax, llama4-temp, mscale): loss per "
        "position, the best attention factor per s against YaRN's 0.1 ln s + 1, and its slope.",
    stores={"extend": Trials("extend", {"factor": FACTORS, "treatment": TREATMENTS,
                                        "window": WINDOWS})},
    quick={"extend": Trials("extend", {"factor": FACTORS, "treatment": (NATIVE, HF_YARN),
                                       "window": WINDOWS[:1]})},
    quick_doc="native and hf-yarn at s = 2 on one window",
    analyse=analyse, summary=SUMMARY, figures=tuple(FIGURES.values()),
    page_figures={FIGURES["loss"]: "loss against position past the trained context",
                  FIGURES["factor"]: "the best attention factor against YaRN's rule"},
    options=(
        Option("--checkpoint", "checkpoint", "the checkpoint: a save_pretrained folder or a "
               ".gguf file (required for a new folder)", axis=False, metavar="PATH",
               default_text="none"),
        Option("--factors", "factor", "extension factors s > 1: windows of s times the "
               "trained context"),
        Option("--treatments", "treatment", "treatments: native, hf-yarn, "
               "hf-yarn(attention_factor=A), or a mechanism with options, e.g. "
               "ssmax(s=0.2)", check=_check_treatment),
        Option("--windows", "window", "indices of the non-overlapping windows of the text",
               minimum=0),
        Option("--text", "text", "a UTF-8 text file to read (default: text that ships with "
               "Python)", axis=False, metavar="FILE", default_text="Python's own text"),
        Option("--train-len", "train_len", "the trained context L (default: read from the "
               "checkpoint's config)", axis=False, minimum=2, default_text="from the config"),
    ),
    examples="""
  attnscale study extension --checkpoint smollm2.gguf --out extension/ --windows 0,1,2
  attnscale study extension --checkpoint model/ --out ext/ --factors 2,4 \\
      --treatments "native,hf-yarn,hf-yarn(attention_factor=1.2),logn"
""",
))
