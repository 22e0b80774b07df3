"""The temperature report's files: ``records.json`` (the one store), ``report.md`` and the figures,
all drawn from the store, so :func:`redraw` rewrites them byte for byte without the model.

Figures: ``heatmaps.png`` (per layer × head: logit std, entropy ÷ ln n, max weight, coherence),
``drift.png`` (trained vs freshly initialised, one panel per statistic) and, with a what-if
mechanism, ``whatif.png`` (the checkpoint's temperature vs the swapped one).  A figure this report
does not draw is removed where an earlier report left it.

One writer per folder: :func:`writing` holds the folder's lock (:func:`attnscale.io.exclusive`)
for a whole run, so a second run into the same folder is refused before it loads a model, and the
files are recorded in the folder's manifest as :data:`WRITER`'s, so a file of the same name that
another command wrote (``attnscale monitor``'s ``records.json``) is refused unless forced.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from attnscale.errors import ConfigError
from attnscale.formatting import cell, number
from attnscale.inspect.owner import QK_NORM_WORDS, option_defaults, whatif_identity
from attnscale.inspect.records import COMPARED, check_store, median
from attnscale.io import check_output_path, exclusive, staged_dir

RECORDS = "records.json"
REPORT = "report.md"
HEATMAPS = "heatmaps.png"
DRIFT = "drift.png"
WHATIF = "whatif.png"
OUT_FILES = (RECORDS, REPORT, HEATMAPS, DRIFT, WHATIF)
# The writer the folder's manifest names for these files (attnscale.io.written_by).
WRITER = "attnscale inspect"

# The heatmaps: statistic, its label and its fixed colour scale (None: from 0 to the data's max;
# "sqrt_d": from 0 to sqrt(d_head), so 1 is independence and the top is full alignment).
HEATMAP_STATS = (("logit_std", "logit std", None),
                 ("entropy_ratio", "entropy ÷ ln n", (0.0, 1.0)),
                 ("max_weight_mean", "mean max weight", (0.0, 1.0)),
                 ("coherence", "coherence", "sqrt_d"))
# The statistics the drift figure plots, trained against init (log axes for scales).
DRIFT_STATS = ("logit_std", "entropy_ratio", "max_weight_mean", "jacobian_fro_mean", "coherence",
               "q_rms", "k_rms")
LOG_STATS = ("logit_std", "q_rms", "k_rms")
# The statistics that the footnote's premise puts at 1 (dotted lines in the scatter).
UNIT_STATS = ("logit_std", "coherence", "q_rms", "k_rms")
LABELS = {"logit_std": "logit std", "entropy_ratio": "entropy ÷ ln n",
          "max_weight_mean": "max weight", "jacobian_fro_mean": "‖J‖_F", "coherence": "coherence",
          "q_rms": "q rms", "k_rms": "k rms"}


def fmt(x, digits: str = "{:.3g}") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return number(x, digits)


# --- figures -------------------------------------------------------------------------------------

def _grid(rows: Sequence[Mapping], key: str) -> list[list[float]]:
    n_layers = 1 + max(r["layer"] for r in rows)
    n_heads = 1 + max(r["head"] for r in rows)
    grid = [[math.nan] * n_heads for _ in range(n_layers)]
    for r in rows:
        v = r.get(key)
        grid[r["layer"]][r["head"]] = math.nan if v is None else float(v)
    return grid


def draw_heatmaps(rows: Sequence[Mapping], path: Path, title: str) -> None:
    """Per layer × head heatmaps of :data:`HEATMAP_STATS`, each on its stated colour scale."""
    from attnscale.plotting import new_figure, save

    n_layers = 1 + max(r["layer"] for r in rows)
    n_heads = 1 + max(r["head"] for r in rows)
    fig, axes = new_figure(len(HEATMAP_STATS), width=max(3.6, 1.4 + 0.28 * n_heads),
                           height=max(3.0, 1.3 + 0.26 * n_layers))
    for ax, (key, label, limits) in zip(axes, HEATMAP_STATS):
        grid = _grid(rows, key)
        finite = [v for line in grid for v in line if math.isfinite(v)]
        if limits == "sqrt_d":
            top = max((r["sqrt_d"] for r in rows if r.get("sqrt_d")), default=1.0)
            limits, label = (0.0, top), f"{label} (1 = independent, {top:.3g} = √d: aligned)"
        elif limits is None:
            limits = (0.0, max(finite, default=1.0))
        image = ax.imshow(grid, aspect="auto", cmap="viridis", origin="upper", vmin=limits[0],
                          vmax=limits[1], interpolation="nearest")
        bar = ax.figure.colorbar(image, ax=ax)
        bar.formatter.set_useOffset(False)
        bar.update_ticks()
        if n_layers * n_heads <= 128:
            for r in rows:
                v = r.get(key)
                if v is not None and math.isfinite(v):
                    ax.text(r["head"], r["layer"], f"{v:.2g}", ha="center", va="center",
                            fontsize=6, color="white")
        sat = [(r["head"], r["layer"]) for r in rows if r.get("saturated")]
        if sat:  # saturated heads outlined in red on every panel
            ax.scatter(*zip(*sat), s=60, facecolors="none", edgecolors="red", linewidths=1.2)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(0, n_heads, max(1, n_heads // 12)))
        ax.set_yticks(range(0, n_layers, max(1, n_layers // 24)))
    fig.suptitle(title + " (saturated heads circled)", fontsize=10)
    save(fig, path)


def draw_scatter(rows: Sequence[Mapping], path: Path, title: str, prefix: str,
                 xlabel: str) -> None:
    """Per statistic, the checkpoint's value per head (y) against the ``prefix`` pass's (x), with
    y = x; one colour per layer, log axes for scales."""
    import matplotlib
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from attnscale.plotting import plt, save

    stats = [s for s in DRIFT_STATS if any(r.get(prefix + s) is not None for r in rows)]
    cols = min(4, len(stats))
    n_rows = math.ceil(len(stats) / cols)
    fig, grid = plt.subplots(n_rows, cols, figsize=(3.2 * cols, 3.0 * n_rows), squeeze=False)
    axes = grid.flatten()
    n_layers = 1 + max(r["layer"] for r in rows)
    cmap = matplotlib.colormaps["viridis"]
    for ax, s in zip(axes, stats):
        pts = [(r[prefix + s], r[s], r["layer"]) for r in rows
               if _finite(r.get(prefix + s)) and _finite(r.get(s))
               and (s not in LOG_STATS or (r[prefix + s] > 0 and r[s] > 0))]
        if pts:
            x, y, layer = zip(*pts)
            ax.scatter(x, y, s=10, c=[cmap(v / max(1, n_layers - 1)) for v in layer])
            lo, hi = min(min(x), min(y)), max(max(x), max(y))
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
            if s in LOG_STATS:
                ax.set_xscale("log")
                ax.set_yscale("log")
                for axis in (ax.xaxis, ax.yaxis):  # 0.1, 0.2, 0.5, 1, 2, 5... written plainly
                    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
                    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                    axis.set_minor_formatter(NullFormatter())
            if s in UNIT_STATS:  # the footnote's premise: 1 for each of these
                ax.axhline(1.0, color="grey", lw=0.6, ls=":")
                ax.axvline(1.0, color="grey", lw=0.6, ls=":")
        ax.set_title(LABELS[s], fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("checkpoint", fontsize=8)
    for ax in axes[len(stats):]:
        ax.axis("off")
    fig.suptitle(f"{title} (colour: layer 0 to {n_layers - 1}; dashed: y = x; dotted: the "
                 "footnote's premise, 1)", fontsize=10)
    save(fig, path)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --- report.md -----------------------------------------------------------------------------------

def _heads(k: int, n: int) -> str:
    """``k of n heads is`` / ``are``."""
    return f"{k} of {n} heads {'is' if k == 1 else 'are'}"


def verdict(payload: Mapping) -> list[str]:
    """The verdict's sentences: the owner, saturated heads, coherence, drift, and the premise."""
    s, meta = payload["summary"], payload["meta"]
    d = "/".join(str(x) for x in s["d_head"]) or "?"
    lines = [payload["owner"]]
    lines.append(f"{_heads(s['saturated_heads'], s['heads'])} saturated (mean max weight "
                 f"above {s['thresholds']['max_weight']:g} or entropy below "
                 f"{s['thresholds']['entropy_fraction']:g} of ln n).")
    lines.append(f"Median coherence {fmt(s['median_coherence'])} at d_head {d}: 1 is the "
                 f"independent q and k the √d footnote assumes, √d = "
                 f"{fmt(s['median_sqrt_d'])} fully aligned ones.")
    if "median_drift_logit_std" in s:
        lines.append(f"Median drift from a fresh initialisation (seed {meta['seed']}): logit std "
                     f"×{fmt(s['median_drift_logit_std'])}, coherence "
                     f"×{fmt(s['median_drift_coherence'])}.")
        lines.append(premise_sentence(s))
    lines.append(calibration_sentence(s))
    same = whatif_sentence(payload)
    if same:
        lines.append(same)
    return lines


# Relative difference of the what-if's logit std from the checkpoint's, per head, up to which the
# two passes count as the same numbers (float32 statistics of one forward pass, run twice).
SAME_RTOL = 1e-5


def whatif_sentence(payload: Mapping) -> str | None:
    """Why a what-if changes nothing, where it is the identity at this length
    (:func:`attnscale.inspect.owner.whatif_identity`: yarn at factor 1, logn below its training
    length...): what it applies, its options where they are its defaults, and whether its
    numbers equal the checkpoint's.  None for a what-if that acts (or none)."""
    meta, rows = payload["meta"], payload["records"]
    spec = meta.get("whatif")
    if not spec or not any(r.get("whatif_logit_std") is not None for r in rows):
        return None
    n_keys = max((r["n_keys"] for r in rows if r.get("n_keys")), default=meta["seq_len"])
    shapes = {(r["d_head"], sum(x["layer"] == r["layer"] for x in rows)) for r in rows
              if r.get("d_head")}
    if not shapes or not all(whatif_identity(spec, d, h, n_keys) for d, h in shapes):
        return None
    name = spec.partition("(")[0].strip()
    defaults = option_defaults(name)
    given = "(" in spec
    options = ("" if given or not defaults else
               f" with its default options ({', '.join(f'{k}={v}' for k, v in defaults.items())}"
               f"; give others as `--mechanism '{name}({next(iter(defaults))}=...)'`)")
    text = (f"At N = {meta['seq_len']} the what-if `{spec}`{options} gives every query (each "
            f"attends at most {n_keys} keys) the plain scale 1/√d, as `scaled` does: at this "
            "length it is the identity on a 1/√d model")
    gaps = [abs(r["whatif_logit_std"] / r["logit_std"] - 1) for r in rows
            if _finite(r.get("whatif_logit_std")) and _finite(r.get("logit_std"))
            and r["logit_std"] != 0]
    if gaps and max(gaps) <= SAME_RTOL:
        within = ("the same logit std on every head" if max(gaps) == 0 else
                  f"logit std within {max(gaps):.1g} relative on every head")
        return (text + f", and its numbers are the checkpoint's ({within}): this checkpoint's "
                "temperature is 1/√d already.")
    return text + ", which this checkpoint's temperature is not."


def premise_sentence(s: Mapping) -> str:
    """Whether the initialisation met the footnote's premise (unit-variance q and k)."""
    q, k, z = s["median_init_q_rms"], s["median_init_k_rms"], s["median_init_logit_std"]
    if s["premise_at_init"]:
        return (f"At initialisation q and k had components of rms {fmt(q)} and {fmt(k)}, "
                f"close to the footnote's premise of 1, and logits of std {fmt(z)}.")
    calibrated = ("so the initialisation itself calibrated the logits (the divisor lives there)"
                  if s["calibrated_at_init"] else
                  "so the divisor was never calibrated, even at step 0")
    return (f"The initialisation never met the footnote's premise: q and k had components of "
            f"rms {fmt(q)} and {fmt(k)}, not 1, and the logits had std {fmt(z)}, not 1; "
            f"{calibrated}.")


def calibration_sentence(s: Mapping) -> str:
    """Whether the logits the softmax sees now have about unit std (what the divisor aims at)."""
    z = s["median_logit_std"]
    parts = (f"median q rms {fmt(s['median_q_rms'])}, k rms {fmt(s['median_k_rms'])}, "
             f"coherence {fmt(s['median_coherence'])}")
    if s["calibrated_now"]:
        return (f"After training the logits have median std {fmt(z)}: within a factor "
                f"{s['thresholds']['premise_factor']:g} of the unit scale the divisor aims at "
                f"({parts}).")
    return (f"After training the logits have median std {fmt(z)}: the divisor no longer "
            f"yields unit-scale logits ({parts}).")


def _layer_table(payload: Mapping) -> list[str]:
    rows = payload["records"]
    head = ["layer", "heads", "saturated", *[LABELS[s] for s in COMPARED]]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for layer in sorted({r["layer"] for r in rows}):
        rs = [r for r in rows if r["layer"] == layer]
        out.append("| " + " | ".join([str(layer), str(len(rs)),
                                      str(sum(bool(r["saturated"]) for r in rs)),
                                      *[fmt(median(rs, s)) for s in COMPARED]]) + " |")
    return out


def _owner_table(payload: Mapping) -> list[str]:
    """The owner's facts per layer; consecutive layers with the same facts share one row."""
    head = ["layers", "scale", "equals", "family's rule", "q/k norm", "soft-cap", "sinks",
            "sliding window", "position bias", "mechanisms"]
    runs: list[tuple[list[int], list[str]]] = []
    for r in payload["layers"]:
        qk = "—" if not r["qk_norm"] else QK_NORM_WORDS.get(r["qk_norm"], r["qk_norm"])
        if r.get("q_gain") and r.get("k_gain"):
            qk += (f" (gains q {fmt(r['q_gain']['min'])}–{fmt(r['q_gain']['max'])}, "
                   f"k {fmt(r['k_gain']['min'])}–{fmt(r['k_gain']['max'])}; q rms · k rms "
                   f"{fmt(r['qk_scale_median'])})")
        cells = [fmt(r["scale"], "{:.6g}"), r["scaling"], r.get("scaling_rule") or "unknown",
                 qk, fmt(r["softcap"], "{:g}"), "yes" if r["sinks"] else "no",
                 fmt(r["sliding_window"], "{}"), r["position_bias"] or "—",
                 ", ".join(f"`{m}`" for m in r["mechanisms"]) or "—"]
        if runs and runs[-1][1] == cells and runs[-1][0][-1] == r["layer"] - 1:
            runs[-1][0].append(r["layer"])
        else:
            runs.append(([r["layer"]], cells))
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for layers, cells in runs:
        which = str(layers[0]) if len(layers) == 1 else f"{layers[0]}–{layers[-1]}"
        out.append("| " + " | ".join(cell(x) for x in [which, *cells]) + " |")
    return out


def _saturated_table(payload: Mapping) -> list[str]:
    sat = payload["summary"]["saturated"]
    if not sat:
        return ["No head is saturated."]
    out = ["Their softmax Jacobian norm is the factor every gradient to W_Q and W_K passes "
           "through: where it is small, routing has stopped learning.", "",
           "| layer | head | max weight | entropy ÷ ln n | ‖J‖_F |", "|---|---|---|---|---|"]
    for r in sat:
        out.append(f"| {r['layer']} | {r['head']} | {fmt(r['max_weight_mean'])} | "
                   f"{fmt(r['entropy_ratio'])} | {fmt(r['jacobian_fro_mean'])} |")
    return out


def _compare_table(payload: Mapping, prefix: str, column: str, ratio: bool) -> list[str]:
    """Median over heads of each statistic: the checkpoint's against the ``prefix`` pass's
    (``init_`` or ``whatif_``), with the median drift per head when ``ratio``."""
    s = payload["summary"]
    head = ["statistic", f"{column} (median over heads)", "checkpoint"]
    head += ["drift (median of trained ÷ init per head)"] if ratio else []
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for st in COMPARED:
        cells = [LABELS[st], fmt(s[f"median_{prefix}{st}"]), fmt(s[f"median_{st}"])]
        cells += [f"×{fmt(s[f'median_drift_{st}'])}"] if ratio else []
        out.append("| " + " | ".join(cells) + " |")
    if not ratio:
        out.append(f"| saturated heads | {s[f'{prefix}saturated_heads']} | "
                   f"{s['saturated_heads']} |")
    return out


def essay_claims(payload: Mapping) -> list[str]:
    """What the checkpoint says about the essay's claims, in the numbers of its records."""
    s = payload["summary"]
    out = ["- **Is the √d divisor still calibrated after training?** " + calibration_sentence(s)]
    if "premise_at_init" in s:
        out.append("- **Was it calibrated at step 0?** " + premise_sentence(s))
    out.append(f"- **Does saturation freeze routing?** "
               f"{_heads(s['saturated_heads'], s['heads'])} saturated; their median ‖J‖_F is "
               f"{fmt(median(s['saturated'], 'jacobian_fro_mean'))} against "
               f"{fmt(s['median_jacobian_fro_mean'])} for the median head.")
    coh, top = s["median_coherence"], s["median_sqrt_d"]
    where = ("closer to independence (1) than to alignment (√d)"
             if _finite(coh) and _finite(top) and coh < math.sqrt(top) else
             "closer to alignment (√d) than to independence (1)")
    drift = (f", ×{fmt(s['median_drift_coherence'])} its value at initialisation"
             if "median_drift_coherence" in s else "")
    out.append(f"- **Does training align q and k (the μP argument)?** Median coherence "
               f"{fmt(coh)} (heads from {fmt(min_of(payload['records'], 'coherence'))} to "
               f"{fmt(max_of(payload['records'], 'coherence'))}){drift}: {where} on a "
               f"geometric scale, where √d = {fmt(top)}.")
    return out


def min_of(rows: Sequence[Mapping], key: str) -> float:
    values = [r[key] for r in rows if _finite(r.get(key))]
    return min(values) if values else math.nan


def max_of(rows: Sequence[Mapping], key: str) -> float:
    values = [r[key] for r in rows if _finite(r.get(key))]
    return max(values) if values else math.nan


def _reproduce(meta: Mapping) -> list[str]:
    """The command that measures a checkpoint the same way (for a checkpoint read from a folder)."""
    if "model_dir" not in meta:
        return []
    argv = ["attnscale inspect MODEL_DIR"]
    if meta.get("text_file"):
        argv.append("--text FILE")
    argv.append(f"--seq-len {meta['seq_len']}")
    if meta.get("seed"):
        argv.append(f"--seed {meta['seed']}")
    if not meta.get("init", True):
        argv.append("--no-init")
    if meta.get("whatif"):
        argv.append(f"--mechanism {shlex.quote(meta['whatif'])}")
    argv.append(f"--name {shlex.quote(meta['name'])}")
    return [f"Measured with `{' '.join(argv)}`.", ""]


def render(payload: Mapping) -> str:
    """``report.md`` from the contents of ``records.json``."""
    meta, s = payload["meta"], payload["summary"]
    lines = [f"# Temperature report: {meta['name']}", "",
             "**Verdict.** " + " ".join(verdict(payload)), "",
             f"Measured on {meta['input']}, N = {meta['seq_len']} tokens; the model in "
             f"{meta['dtype']} on {meta['device']}, statistics in float32 or better over the keys "
             f"each query attends ({meta['model_type']}, {s['layers']} attention layers, "
             f"{s['heads']} heads; attnscale {meta['attnscale']}). Every number here is read from "
             f"[{RECORDS}]({RECORDS}); `attnscale inspect --from DIR` redraws this page and its "
             "figures from it.", "", *_reproduce(meta),
             "## Who owns the temperature", "", payload["owner"], "",
             *_owner_table(payload), "",
             "## What the temperature is now", "",
             "Medians over each layer's heads. Entropy ÷ ln n is 1 for uniform attention and 0 "
             "for one-hot; coherence is std_i(q·k_i) ÷ (|q| · rms_i|k_i| / √d): about 1 for "
             "independent q and k, √d when they are aligned. A row's logit std is scale · √d · "
             "q rms · k rms · coherence (without a cap or bias).", "",
             *_layer_table(payload), "", f"![per layer and head]({HEATMAPS})", "",
             "## Saturated heads", "", *_saturated_table(payload), ""]
    if "median_drift_logit_std" in s:
        lines += ["## How far it has drifted", "",
                  f"The same architecture freshly initialised by its own `_init_weights` (seed "
                  f"{meta['seed']}), on the same tokens.", "", premise_sentence(s), "",
                  *_compare_table(payload, "init_", "init", ratio=True), "", f"![checkpoint vs initialisation]({DRIFT})", ""]
    if "median_whatif_logit_std" in s:
        same = whatif_sentence(payload)
        lines += [f"## What if: `{meta['whatif']}`", "",
                  f"The checkpoint with its temperature swapped for a freshly built "
                  f"`{meta['whatif']}` (attnscale.hf.set_mechanism), on the same tokens.", "",
                  *([same, ""] if same else []),
                  *_compare_table(payload, "whatif_", "what-if", ratio=False), "", f"![checkpoint vs what-if]({WHATIF})", ""]
    lines += ["## The essay's claims on this checkpoint", "", *essay_claims(payload), "",
              "## Fields", "", f"One record per (layer, head) in [{RECORDS}]({RECORDS}):", "",
              "| field | meaning |", "|---|---|",
              *[f"| `{k}` | {cell(v)} |" for k, v in payload["fields"].items()], ""]
    return "\n".join(lines)


def _draw(payload: Mapping, folder: Path) -> None:
    meta, rows = payload["meta"], payload["records"]
    title = f"{meta['name']} · N={meta['seq_len']}"
    draw_heatmaps(rows, folder / HEATMAPS, title)
    if any(r.get("init_logit_std") is not None for r in rows):
        draw_scatter(rows, folder / DRIFT, title, "init_", "fresh initialisation")
    if any(r.get("whatif_logit_std") is not None for r in rows):
        draw_scatter(rows, folder / WHATIF, title, "whatif_", f"what-if: {meta['whatif']}")
    (folder / REPORT).write_text(render(payload), encoding="utf-8")


def dumps(payload: Mapping) -> str:
    """``records.json``'s text: strict JSON (NaN as null), one record per line block."""
    from attnscale.io import json_safe
    return json.dumps(json_safe(dict(payload)), indent=1, allow_nan=False) + "\n"


# The folders this process holds the writer lock of, each with the holding thread.
_HELD: dict[Path, int] = {}


def check_out(out: str | os.PathLike, *, force: bool = False, param: str = "out") -> Path:
    """``out`` checked as a report folder (attnscale.io.check_output_path): every one of
    :data:`OUT_FILES` in it must be one that attnscale inspect wrote, unless ``force``."""
    return check_output_path(param, out, kind="dir", files=OUT_FILES, force=force, writer=WRITER)


@contextlib.contextmanager
def writing(out: str | os.PathLike, *, force: bool = False, param: str = "out") -> Iterator[Path]:
    """Hold the writer lock of the report folder ``out`` for the block (a whole run: load,
    measure, write), so a second writer of it, in this process or another, is refused up front
    with a ConfigError naming the holder's PID; the folder is checked (:func:`check_out`) before
    and again under the lock.  :func:`write` and :func:`redraw` inside the block (same thread)
    use the lock held; outside one they take it themselves."""
    out = check_out(out, force=force, param=param)
    key = out.resolve()
    if _HELD.get(key) == threading.get_ident():
        yield out
        return
    with exclusive(out, param=param):
        _HELD[key] = threading.get_ident()
        try:
            yield check_out(out, force=force, param=param)
        finally:
            del _HELD[key]


def write(payload: Mapping, out: str | os.PathLike, *, force: bool = False,
          param: str = "out") -> Path:
    """Write records.json, report.md and the figures into ``out``, all or nothing, under the
    folder's writer lock (:func:`writing`); a figure of an earlier report that this one does not
    draw is removed."""
    with writing(out, force=force, param=param) as out, \
            staged_dir(out, param=param, force=force, writer=WRITER,
                       replaces=OUT_FILES) as staging:
        (staging / RECORDS).write_text(dumps(payload), encoding="utf-8")
        _draw(json.loads(dumps(payload)), staging)  # drawn from what the store holds
    return Path(out)


def load(folder: str | os.PathLike, param: str = "from") -> dict:
    """The contents of ``folder/records.json``, checked field by field to be a report's store
    (:func:`attnscale.inspect.records.check_store`)."""
    path = Path(folder) / RECORDS
    if not path.is_file():
        raise ConfigError(f"{param} {str(folder)!r} holds no {RECORDS} (a folder written by "
                          "attnscale inspect).")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ConfigError(f"{param} {str(path)!r} is not valid JSON ({err}).") from None
    return check_store(payload, f"{param} {str(path)!r}")


def _no_constant(name: str):
    """records.json is strict JSON (NaN is written as null): NaN and Infinity are refused."""
    raise ValueError(f"{name} is not JSON; attnscale writes NaN as null")


def redraw(folder: str | os.PathLike, *, force: bool = False, param: str = "from") -> Path:
    """Redraw report.md and the figures in ``folder`` from its records.json alone, under the
    folder's writer lock (:func:`writing`)."""
    load(folder, param)  # a folder without a report is refused before anything is made
    with writing(folder, force=force, param=param):
        payload = load(folder, param)  # as it is under the lock
        with staged_dir(folder, param=param, force=force, writer=WRITER,
                        replaces=[n for n in OUT_FILES if n != RECORDS]) as staging:
            _draw(payload, staging)
    return Path(folder)
