"""One model at several lengths on the same text prefix: per head, how its attention entropy and its
largest logit grow with the number of keys, and which heads disperse as keys are added.

Input: the model's reports (:func:`attnscale.inspect.inspect_model` payloads, or their
``records.json``) by sequence length, each on a prefix of the same tokens.  Per head, two
least-squares slopes over the lengths (with the number of lengths used):

* ``entropy_slope``: d entropy_mean / d mean_ln_keys, entropy in nats.  ``mean_ln_keys`` is the
  mean over rows of ln n with n the keys the row attends (causal rows attend fewer than N), so a
  row law H = a + b ln n is exactly entropy_mean = a + b · mean_ln_keys.  The slope is the exponent
  of the effective number of keys, e^H ∝ n^b: 1 for uniform attention and for a fixed temperature
  over i.i.d. logits (H ≈ ln n − σ²/2), the fading of attention that SSMax (Nakanishi 2025, arXiv
  2501.19399) and log-n scaling correct; 0 for a head that keeps its mass on a fixed set of keys.
* ``peak_slope``: d (largest logit) / d ln n_keys, with n_keys the most keys a row attends.  The
  records carry ``logit_absmax`` (the largest |logit| over every row and attended key); the signed
  ``logit_max`` is the guard's statistic, not a record's, and is used instead where every record
  carries it.

A head *disperses* when its entropy slope is at least :data:`DISPERSING_SLOPE` and *holds*
otherwise.  The keys of a sliding-window layer stop growing at its window, so a head is fitted
only over the lengths where its keys still grow, and left unfitted with fewer than
:data:`MIN_LENGTHS`: the lengths up to the layer's window (the family's fact,
``layers[i]["sliding_window"]``) and, whatever the facts say, up to the first length at which
the records' ``n_keys`` (the most keys a row attends, as the mask says) stops growing (a window
the family table does not know).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from attnscale.errors import ConfigError, check_int, spelled
from attnscale.formatting import cell
from attnscale.inspect.records import median
from attnscale.inspect.report import fmt
from attnscale.inspect.trajectory import architecture, check_payload, num

# The files this analysis gives beside the reports it reads: its page and its figure.
PAGE, FIGURE = "lengths.md", "lengths.png"
# A head disperses when its entropy grows at least half as fast as ln n: e^H, its effective number
# of keys, then grows at least like √n, the geometric midpoint between a head that holds its keys
# (slope 0) and uniform or fixed-temperature attention (slope 1).  A fixed fraction, not the
# slope's standard error: with the two to four lengths a study measures, that error has zero to
# two degrees of freedom.
DISPERSING_SLOPE = 0.5
# The fewest lengths a slope is fitted over.
MIN_LENGTHS = 2


def _param() -> str:
    return spelled("--lengths", "payloads_by_length")


def check_lengths(payloads_by_length) -> dict[int, Mapping]:
    """The reports by length, checked: at least two distinct lengths (20, 20.0 and "20" are one),
    one architecture, each report measured at its length, the shorter tokens a prefix of the
    longer.  Sorted by length."""
    param = _param()
    if not isinstance(payloads_by_length, Mapping):
        raise ConfigError(f"{param} must map each length to its report.")
    out: dict[int, Mapping] = {}
    for key, payload in payloads_by_length.items():
        n = check_int(param, key, minimum=1)
        if n in out:
            raise ConfigError(f"{param} lists {n} more than once; each length must be distinct.")
        out[n] = check_payload(param, payload, f" at length {n}")
        seq = payload["meta"].get("seq_len")
        if seq is not None and seq != n:
            raise ConfigError(f"{param}: the report given for length {n} was measured at "
                              f"{seq} tokens.")
    if len(out) < MIN_LENGTHS:
        raise ConfigError(f"{param} must hold at least {MIN_LENGTHS} lengths, got {len(out)}.")
    out = dict(sorted(out.items()))
    (n0, first), *rest = out.items()
    for n, payload in rest:
        if architecture(payload) != architecture(first):
            raise ConfigError(f"{param}: the report at length {n} is another model than the one "
                              f"at length {n0}; a length study measures one model.")
    tokens = [(n, p["meta"].get("token_ids")) for n, p in out.items()]
    longest_n, longest = tokens[-1]
    for n, ids in tokens[:-1]:
        if ids is not None and longest is not None and \
                [row[:n] for row in longest] != [row[:n] for row in ids]:
            raise ConfigError(f"{param}: the tokens at length {n} are not a prefix of those at "
                              f"length {longest_n}; every length reads the same text.")
    return out


def peak_key(payloads: Sequence[Mapping]) -> str:
    """``logit_max`` where every record carries a finite one, else ``logit_absmax``."""
    every = all(math.isfinite(num(r.get("logit_max"))) for p in payloads for r in p["records"])
    return "logit_max" if every else "logit_absmax"


def fit_slope(x: Sequence[float], y: Sequence[float]) -> dict:
    """The least-squares line y = a + b x: ``slope`` Σ(x - x̄)(y - ȳ) / Σ(x - x̄)², its standard
    error sqrt(Σ residual² / (m - 2) / Σ(x - x̄)²) (None with m < 3 points, no degree of freedom
    left), ``intercept`` and ``points`` m.  Sums exactly rounded (math.fsum), so a redraw gives
    the same digits on every CPU."""
    m = len(x)
    x_mean, y_mean = math.fsum(x) / m, math.fsum(y) / m
    sxx = math.fsum((a - x_mean) ** 2 for a in x)
    if sxx <= 0:
        return {"slope": math.nan, "slope_se": None, "intercept": math.nan, "points": m}
    slope = math.fsum((a - x_mean) * (b - y_mean) for a, b in zip(x, y)) / sxx
    intercept = y_mean - slope * x_mean
    se = None
    if m > 2:
        rss = math.fsum((b - intercept - slope * a) ** 2 for a, b in zip(x, y))
        se = math.sqrt(rss / (m - 2) / sxx)
    return {"slope": slope, "slope_se": se, "intercept": intercept, "points": m}


def layer_windows(payload: Mapping) -> dict[int, int | None]:
    """Each layer's sliding window (None: the keys grow with the sequence)."""
    return {row["layer"]: row.get("sliding_window") for row in payload["layers"]}


def growing(lengths: Sequence[int], n_keys: Sequence[float], window: int | None) -> list[int]:
    """The indices of the lengths where a head's keys still grow: up to ``window`` (None: no
    window), and up to the first length whose ``n_keys`` is not above the previous length's."""
    out: list[int] = []
    for i, n in enumerate(lengths):
        if window is not None and n > window:
            break
        if out and not n_keys[i] > n_keys[out[-1]]:
            break
        out.append(i)
    return out


def keys_note(window: int | None, lengths: Sequence[int], used: Sequence[int],
              stop: float | None) -> str:
    """Why a layer is fitted over the lengths it is, in words; ``stop``: the most keys a row
    attends at the first length left out, where the keys stopped (None: none was)."""
    fitted = (f"fitted over {len(used)} lengths" if len(used) >= MIN_LENGTHS else
              f"not fitted: fewer than {MIN_LENGTHS} lengths where its keys still grow")
    if window is not None and (stop is not None or len(used) < MIN_LENGTHS):
        return f"window {window}, keys stop at {window}; {fitted}"
    if window is not None:
        return f"window {window}, above every length; {fitted}"
    if stop is not None:
        return f"keys stop at {stop:g} (measured); {fitted}"
    return fitted


def length_rows(payloads_by_length: Mapping[int, Mapping]) -> list[dict]:
    """One row per (layer, head): ``layer``, ``head``, ``module``, ``window``, ``lengths`` (all,
    ascending), ``lengths_fitted``, ``fitted``, ``note`` (:func:`keys_note`), per length
    ``mean_ln_keys``, ``entropy``, ``ln_n_keys`` and ``peak``, ``peak_key``, the fits
    ``entropy_slope``, ``entropy_slope_se``, ``entropy_intercept``, ``peak_slope``,
    ``peak_slope_se`` (None unfitted, the standard errors None with fewer than 3 lengths) and
    ``dispersing`` (entropy_slope ≥ :data:`DISPERSING_SLOPE`; None unfitted).  JSON-safe after
    :func:`attnscale.io.json_safe`."""
    by_length = check_lengths(payloads_by_length)
    lengths = list(by_length)
    payloads = list(by_length.values())
    peak = peak_key(payloads)
    windows = layer_windows(payloads[0])
    keyed = [{(r["layer"], r["head"]): r for r in p["records"]} for p in payloads]
    rows = []
    for r0 in payloads[0]["records"]:
        at = (r0["layer"], r0["head"])
        recs = [k[at] for k in keyed]
        window = windows.get(r0["layer"])
        row = {"layer": r0["layer"], "head": r0["head"], "module": r0["module"],
               "window": window, "lengths": lengths,
               "mean_ln_keys": [num(r.get("mean_ln_keys")) for r in recs],
               "entropy": [num(r.get("entropy_mean")) for r in recs],
               "ln_n_keys": [math.log(r["n_keys"]) if num(r.get("n_keys")) > 0 else math.nan
                             for r in recs],
               "peak": [num(r.get(peak)) for r in recs], "peak_key": peak}
        keys = [num(r.get("n_keys")) for r in recs]
        grow = growing(lengths, keys, window)
        stop = keys[len(grow)] if len(grow) < len(lengths) else None
        use = [i for i in grow if all(math.isfinite(row[k][i]) for k in
                                      ("mean_ln_keys", "entropy", "ln_n_keys", "peak"))]
        row["lengths_fitted"] = [lengths[i] for i in use]
        row["fitted"] = len(use) >= MIN_LENGTHS
        row["note"] = keys_note(window, lengths, row["lengths_fitted"], stop)
        if row["fitted"]:
            h = fit_slope([row["mean_ln_keys"][i] for i in use], [row["entropy"][i] for i in use])
            z = fit_slope([row["ln_n_keys"][i] for i in use], [row["peak"][i] for i in use])
            row.update(entropy_slope=h["slope"], entropy_slope_se=h["slope_se"],
                       entropy_intercept=h["intercept"], peak_slope=z["slope"],
                       peak_slope_se=z["slope_se"],
                       dispersing=(bool(h["slope"] >= DISPERSING_SLOPE)
                                   if math.isfinite(h["slope"]) else None))
        else:
            row.update(entropy_slope=None, entropy_slope_se=None, entropy_intercept=None,
                       peak_slope=None, peak_slope_se=None, dispersing=None)
        rows.append(row)
    return rows


# --- report and figure -------------------------------------------------------------------------

def layer_summary(rows: Sequence[Mapping]) -> list[dict]:
    """Per layer: its window, note, the medians of both slopes over its fitted heads, and its
    dispersing, holding and unfitted heads."""
    out = []
    for layer in sorted({r["layer"] for r in rows}):
        rs = [r for r in rows if r["layer"] == layer]
        out.append({"layer": layer, "window": rs[0]["window"], "note": rs[0]["note"],
                    "lengths_fitted": rs[0]["lengths_fitted"],
                    "entropy_slope": median(rs, "entropy_slope"),
                    "peak_slope": median(rs, "peak_slope"),
                    "dispersing": [r["head"] for r in rs if r["dispersing"] is True],
                    "holding": [r["head"] for r in rs if r["dispersing"] is False],
                    "unfitted": [r["head"] for r in rs if r["dispersing"] is None]})
    return out


def _heads_by_layer(layers: Sequence[Mapping], key: str) -> str:
    parts = [f"layer {s['layer']}: heads {', '.join(map(str, s[key]))}" for s in layers
             if s[key]]
    return "; ".join(parts) if parts else "none"


def _peak_label(key: str) -> str:
    return "largest logit" if key == "logit_max" else "largest |logit|"


def render_lengths(payloads_by_length: Mapping[int, Mapping], *, name: str | None = None,
                   figure: str | None = FIGURE) -> str:
    """The length study's page (markdown): the verdict, the rule, a table per layer with what its
    keys did, the dispersing and the holding heads by name, and ``figure``
    (:func:`draw_lengths`'s file beside the page, or None)."""
    by_length = check_lengths(payloads_by_length)
    rows = length_rows(by_length)
    layers = layer_summary(rows)
    meta = next(iter(by_length.values()))["meta"]
    fitted = [r for r in rows if r["fitted"]]
    disp = [r for r in fitted if r["dispersing"]]
    peak = _peak_label(rows[0]["peak_key"])
    lengths = ", ".join(map(str, by_length))
    lines = [f"# Temperature against length: {name or meta.get('name') or meta.get('model_type')}",
             "",
             f"**Verdict.** Of {len(fitted)} heads fitted over lengths {lengths}, {len(disp)} "
             f"disperse (entropy growing at least {DISPERSING_SLOPE:g} nats per unit ln n, like "
             f"ln n: what SSMax and log-n scaling correct) and {len(fitted) - len(disp)} hold. "
             f"Median slope of entropy against ln n {fmt(median(fitted, 'entropy_slope'))}, of "
             f"the {peak} {fmt(median(fitted, 'peak_slope'))}."
             + (f" {len(rows) - len(fitted)} heads are not fitted (their layer's keys stop "
                f"growing below two of the lengths)." if len(fitted) < len(rows) else ""), "",
             f"The same {meta.get('model_type')} model read at N = {lengths} tokens, each a "
             "prefix of the same text. Per head, least-squares slopes over the lengths: the "
             "entropy (nats) against the mean over its rows of ln n, n the keys a row attends "
             f"(not the sequence length), and the {peak} against ln of the most keys a row "
             "attends. The entropy slope is the exponent of the effective number of keys, "
             "e^H ∝ n^slope: 1 for uniform attention or a fixed temperature over independent "
             f"logits, 0 for a head that keeps its keys. A head disperses at a slope of at least "
             f"{DISPERSING_SLOPE:g} (e^H growing at least like √n, the geometric midpoint; a fixed "
             "fraction, as the slope's own standard error has no degree of freedom at two "
             "lengths), and holds below it. A sliding-window layer is fitted only over the "
             "lengths at or below its window, where its keys still grow.", ""]
    if figure:
        lines += [f"![entropy and the largest logit against ln n]({figure})", ""]
    lines += ["## Per layer", "",
              "| layer | window | keys | entropy slope (median) | "
              f"{cell(peak)} slope (median) | dispersing | holding |",
              "|---|---|---|---|---|---|---|"]
    for s in layers:
        lines.append(f"| {s['layer']} | {fmt(s['window'], '{}')} | {s['note']} | "
                     f"{fmt(s['entropy_slope'])} | {fmt(s['peak_slope'])} | "
                     f"{len(s['dispersing'])} | {len(s['holding'])} |")
    lines += ["", "## Heads", "",
              f"- **Dispersing** (entropy slope ≥ {DISPERSING_SLOPE:g}): "
              + _heads_by_layer(layers, "dispersing") + ".",
              "- **Holding**: " + _heads_by_layer(layers, "holding") + "."]
    if any(s["unfitted"] for s in layers):
        lines.append("- **Not fitted**: " + "; ".join(
            f"layer {s['layer']} ({s['note']})" for s in layers if s["unfitted"]) + ".")
    lines += ["", "## Slopes per head", "",
              "| layer | head | lengths fitted | entropy slope | ± se | "
              f"{cell(peak)} slope | ± se | disperses |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['head']} | {len(r['lengths_fitted'])} | "
                     f"{fmt(r['entropy_slope'])} | {fmt(r['entropy_slope_se'])} | "
                     f"{fmt(r['peak_slope'])} | {fmt(r['peak_slope_se'])} | "
                     f"{'—' if r['dispersing'] is None else 'yes' if r['dispersing'] else 'no'} |")
    lines.append("")
    return "\n".join(lines)


def draw_lengths(payloads_by_length: Mapping[int, Mapping], path: str | Path, *,
                 name: str | None = None) -> Path:
    """Four panels: entropy against ln n and the largest logit against ln n (median over each
    layer's heads, one line per layer; open markers where a layer's keys have stopped at its
    window; dashed: uniform attention, H = ln n), and the histograms of both slopes over the
    fitted heads (dotted: the dispersing threshold and 1)."""
    import matplotlib

    from attnscale.plotting import new_figure, save

    by_length = check_lengths(payloads_by_length)
    rows = length_rows(by_length)
    lengths = list(by_length)
    layers = sorted({r["layer"] for r in rows})
    cmap = matplotlib.colormaps["viridis"]
    fig, axes = new_figure(4, width=3.6, height=3.2)
    peak = _peak_label(rows[0]["peak_key"])
    for ax, (x_key, y_key, label) in zip(axes, (("mean_ln_keys", "entropy", "entropy (nats)"),
                                                ("ln_n_keys", "peak", peak))):
        for j, layer in enumerate(layers):
            rs = [r for r in rows if r["layer"] == layer]
            window = rs[0]["window"]
            xs = [median([{"v": r[x_key][i]} for r in rs], "v") for i in range(len(lengths))]
            ys = [median([{"v": r[y_key][i]} for r in rs], "v") for i in range(len(lengths))]
            colour = cmap(j / max(1, len(layers) - 1))
            ax.plot(xs, ys, color=colour, lw=1.0,
                    label=f"layer {layer}" if len(layers) <= 8 else None)
            for x, y, n in zip(xs, ys, lengths):
                grows = window is None or n <= window
                ax.scatter([x], [y], s=14, color=colour if grows else "none", edgecolors=colour,
                           zorder=3)
        if y_key == "entropy":
            finite = [x for r in rows for x in r["mean_ln_keys"] if math.isfinite(x)]
            if finite:
                ax.plot([min(finite), max(finite)], [min(finite), max(finite)], color="grey",
                        lw=0.8, ls="--")
        ax.set_xlabel("mean ln n (keys attended)" if x_key == "mean_ln_keys"
                      else "ln n (most keys attended)")
        ax.set_title(f"{label} (median per layer)", fontsize=9)
    if len(layers) <= 8:
        axes[0].legend(fontsize=6)
    for ax, key, label in ((axes[2], "entropy_slope", "entropy slope d H / d ln n"),
                           (axes[3], "peak_slope", f"{peak} slope d z / d ln n")):
        values = [r[key] for r in rows if r["fitted"] and math.isfinite(num(r[key]))]
        if values:
            ax.hist(values, bins=max(5, min(30, len(values) // 3)), color="#1f77b4", alpha=0.8)
        if key == "entropy_slope":
            ax.axvline(DISPERSING_SLOPE, color="red", lw=0.8, ls=":")
            ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_title(f"{label}, {len(values)} heads", fontsize=9)
        ax.set_ylabel("heads")
    meta = next(iter(by_length.values()))["meta"]
    fig.suptitle(f"{name or meta.get('name') or meta.get('model_type')}: N = "
                 f"{', '.join(map(str, lengths))} (open markers: beyond a layer's window)",
                 fontsize=10)
    save(fig, Path(path))
    return Path(path)
