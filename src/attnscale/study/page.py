"""The results page: one markdown page that answers "which mechanism should my model use?" from the
study folders beside it (``DIR/lm``, ``DIR/length``, ``DIR/recall``), every number read from their
stores by the studies' own analysis functions, so the page is redrawn, never typed.

``attnscale results DIR`` writes ``DIR/README.md``; ``--check`` says whether it is up to date with
the stores.  A study folder that is missing or still running is shown as such (k of n runs), and
the page says where the evidence is one width or fewer seeds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from attnscale.errors import ConfigError
from attnscale.formatting import number, with_interval
from attnscale.study import claims as claim_rules

PAGE = "README.md"
# The study folders the page reads, in the order it shows them.
STUDY_FOLDERS = ("lm", "length", "recall")
# The length study's two columns: recall scored at this many pairs, the LM at this multiple of
# its trained context.
RECALL_PAIRS = 512
LM_CONTEXT_FACTOR = 8
# The folder of `attnscale inspect`'s report on a real pretrained checkpoint, linked when present.
CHECKPOINTS = "checkpoints"
# The folder of the extension study on a real checkpoint, linked when present.
EXTENSION = "extension"
# Held-out recall accuracy at which the page calls the task solved by a mechanism (every seed,
# every d_k), so that the recall study's column compares speed alone.
RECALL_SOLVED = 0.95


@dataclass(frozen=True)
class Loaded:
    """One study folder: its records per store (ok runs only) and its run counts."""
    name: str
    records: Mapping[str, list[dict]]
    ok: int
    total: int
    wall_seconds: float
    failed: Mapping[str, int]   # store path, relative to the study folder's parent -> failed runs
    fragment: bool              # whether the folder has its fragment.md


def load(root: str | os.PathLike) -> dict[str, Loaded]:
    """Every study folder of :data:`STUDY_FOLDERS` under ``root`` that holds its study."""
    from attnscale import sweep
    from attnscale.study import get
    from attnscale.study.launcher import store_paths
    from attnscale.sweep.store import Store
    root = Path(root)
    out = {}
    for name in studies_in(root):
        folder = root / name
        records, ok, total, wall, failed = {}, 0, 0, 0.0, {}
        planned = _planned(folder)
        for key, path in store_paths(get(name), folder).items():
            if not Store(path).exists():
                records[key] = []
                total += planned.get(key, 0)  # a store the study has not started yet
                continue
            res = sweep.load(path)
            records[key] = list(res.ok)
            ok += len(res.ok)
            total += len(res.ok) + len(res.failed) + len(res.pending)
            wall += sum(r.get("wall_seconds") or 0.0 for r in res.ok)
            if res.failed:
                failed[path.relative_to(root).as_posix()] = len(res.failed)
        out[name] = Loaded(name, records, ok, total, wall, failed,
                           (folder / "fragment.md").is_file())
    return out


def _planned(folder: Path) -> dict[str, int]:
    """Trials per store of the settings in the folder's ``study.json`` (0 where unreadable)."""
    import json
    import math
    from attnscale.study.launcher import STUDY_FILE
    try:
        stores = json.loads((folder / STUDY_FILE).read_text(encoding="utf-8"))["stores"]
        return {key: math.prod(len(v) for v in s["grid"].values()) for key, s in stores.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


# --- cells ----------------------------------------------------------------------------------------

def _spread_text(s: dict | None, fmt: str = claim_rules.FMT) -> str:
    if s is None or s.get("mean") is None:
        return ""
    if s.get("n", 2) <= 1 or s["min"] == s["max"]:
        return number(s["mean"], fmt)
    return with_interval(s["mean"], [s["min"], s["max"]], fmt)


def lm_range_text(row: dict) -> str:
    """An LM sensitivity cell as the LM study writes it (:func:`attnscale.study.lm.
    sensitivity_text`)."""
    from attnscale.study.lm import sensitivity_text
    return sensitivity_text(row)


def _lr_cell(row: dict) -> str:
    """A highest-LR row's learning rate; ``none`` when no LR trains, ``partial`` when no seed has
    finished its learning-rate grid."""
    if row["lr"] is None:
        return "partial" if not row["seeds"] and row.get("partial") else "none"
    return f"{row['lr']:g}"


def _lm_tables(loaded: Loaded | None) -> dict:
    if loaded is None:
        return {}
    from attnscale.study import lm
    records = lm.study_records(loaded.records)
    if not records:
        return {}
    rows = lm.sensitivity_rows(records)
    sinks = [r["result"] for r in loaded.records.get("sinks", [])]
    return {"records": records, "sensitivity": rows, "highest": lm.highest_lr_rows(records),
            "claims": lm.claims(records) + lm.sink_claims(sinks),
            "widths": sorted({r["width"] for r in rows}),
            "order": lm.variants(records)}


def _length_tables(loaded: Loaded | None) -> dict:
    if loaded is None:
        return {}
    from attnscale.study import length
    recall, lm_runs = loaded.records.get("recall-length", []), loaded.records.get("lm-length", [])
    out = {"claims": length.claims(recall, lm_runs), "recall": {}, "lm": {}}
    for row in length.recall_rows(recall) if recall else []:
        if row["pairs"] == RECALL_PAIRS:
            out["recall"][row["mechanism"]] = {**row["accuracy"], "train": row["train_pairs"]}
    for row in length.lm_rows(lm_runs) if lm_runs else []:
        if row["context"] == LM_CONTEXT_FACTOR * row["train_context"]:
            out["lm"][row["mechanism"]] = {**row["loss"], "train": row["train_context"]}
    return out


def _recall_tables(loaded: Loaded | None) -> dict:
    if loaded is None or not loaded.records.get("recall"):
        return {}
    from attnscale.study import recall
    rows = recall.summary_rows(loaded.records["recall"])
    d_ks = sorted({r["d_k"] for r in rows})
    ends = [d_ks[0], d_ks[-1]] if len(d_ks) > 1 else d_ks
    cells = {}
    for r in rows:
        if r["d_k"] in ends:
            cells.setdefault(r["mechanism"], {})[r["d_k"]] = r
    worst = min(rows, key=lambda r: r["accuracy_min"])
    return {"d_k": ends, "rows": cells, "worst": worst, "all": rows,
            "seeds": max(r["seeds"] for r in rows)}


# --- the page -------------------------------------------------------------------------------------

def _evidence(loaded: Mapping[str, Loaded]) -> list[str]:
    lines = []
    for name in STUDY_FOLDERS:
        got = loaded.get(name)
        if got is None:
            lines.append(f"- **{name}**: not run yet (`attnscale study {name} --out {name}`).")
            continue
        pending = got.total - got.ok - sum(got.failed.values())
        state = "complete" if got.ok == got.total and got.total else \
            "no runs yet" if not got.total else ""
        if pending > 0:
            state = (f"{pending} not run yet: `attnscale study {name} --resume {name}`, run in "
                     "this folder, runs them")
        for store, n in got.failed.items():
            state += ("; " if state else "") + (f"{n} failed: `attnscale sweep --resume {store} "
                                                 "--retry-errors` runs them again")
        details = f" Details: [{name}/fragment.md]({name}/fragment.md)." if got.fragment else ""
        lines.append(f"- **{name}**: {got.ok} of {got.total} runs, {state}; "
                     f"{got.wall_seconds / 3600:.1f} h of trial time.{details}")
    return lines


def _checkpoints(root: Path) -> list[str]:
    """The section on real checkpoints (``attnscale inspect``): every inspection folder under
    :data:`CHECKPOINTS` (one holding ``inspect.json``) linked with what its pages show: models
    side by side, a training run's trajectory, each model against length; every number read
    from the report stores by inspect's own analyses.  Nothing when there is no such folder."""
    from attnscale.inspect.multi import INDEX, load_index
    from attnscale.inspect.report import load

    top = root / CHECKPOINTS
    found = sorted(p for p in top.iterdir() if (p / INDEX).is_file()) if top.is_dir() else []
    if not found:
        return []
    indexes = {p: load_index(p) for p in found}

    def kind(p: Path) -> int:  # models side by side first, then lengths, then runs
        return 0 if len(indexes[p]["sources"]) > 1 else \
            2 if any(s["run"] for s in indexes[p]["sources"]) else 1
    lines = ["## Real checkpoints", "",
             "`attnscale inspect` on real checkpoints; every page is attnscale's, redrawn by "
             "`attnscale inspect --from DIR`"
             + (f", and [make.py]({CHECKPOINTS}/make.py) measures them all again"
                if (top / "make.py").is_file() else "") + ".", ""]
    reports = []
    for folder in sorted(found, key=lambda p: (kind(p), p.name.lower())):
        entries = indexes[folder]["entries"]
        got = {e: load(folder / e.folder) for e in entries}
        at = f"{CHECKPOINTS}/{folder.name}"
        reports += [f"[{e.source}{'' if e.step is None else ' ' + e.checkpoint} at N = "
                    f"{e.seq_len}]({_path(at, e.folder, 'report.md')})" for e in entries]
        sources = list(dict.fromkeys(e.source for e in entries))
        first_n = min(e.seq_len for e in entries)
        if len(sources) > 1:
            lines += _compare_lines(at, [[e for e in entries if e.source == s
                                          and e.seq_len == first_n][-1] for s in sources], got)
        for s in sources:
            mine = [e for e in entries if e.source == s]
            if any(e.step is not None for e in mine):
                lines += _run_lines(at, s, [e for e in mine if e.seq_len == first_n], got,
                                    several_lengths=len({e.seq_len for e in mine}) > 1)
            last = [e for e in mine if e.checkpoint == mine[-1].checkpoint]
            if len(last) > 1:
                lines += _length_lines(at, s, last, got)
    return lines + ["Every report: " + "; ".join(reports) + ".", ""]


def _path(*parts) -> str:
    """A link's target, relative to the page, '.' folders left out."""
    from pathlib import PurePosixPath
    return PurePosixPath(*map(str, parts)).as_posix()


def _fig(x) -> str:
    """Three significant digits, as inspect's pages print their numbers."""
    return number(x, "{:.3g}")


def _compare_lines(at: str, chosen: list, got: Mapping) -> list[str]:
    """Models side by side: one line per model and the comparison's findings."""
    from attnscale.inspect import compare
    rows = compare.compare_rows([got[e] for e in chosen])
    lines = [f"**Side by side** at N = {chosen[0].seq_len} tokens "
             f"([{compare.PAGE}]({_path(at, compare.PAGE)})):", ""]
    for e, r in zip(chosen, rows):
        drift = r["median_drift_logit_std"]
        lines.append(f"- [{r['name']}]({_path(at, e.folder, 'report.md')}) ({r['family']}, {r['layers']} "
                     f"layers, {r['heads']} heads, d_head {'/'.join(map(str, r['d_head']))}): "
                     f"median coherence {_fig(r['median_coherence'])}, logit std "
                     f"{_fig(r['median_logit_std'])}"
                     + ("" if drift is None else f", ×{_fig(drift)} its initialisation's")
                     + f". {r['owner_sentence']} {r['saturated_heads']} of {r['heads']} heads "
                     "saturated.")
    return lines + ["", " ".join(compare.findings(rows)), ""]


def _run_lines(at: str, source: str, run: list, got: Mapping, *,
               several_lengths: bool) -> list[str]:
    """A training run: its trajectory's verdict, and how far its own steps moved the medians."""
    from attnscale.inspect import trajectory
    rows = trajectory.trajectory_rows([(e.step, got[e]) for e in run])
    meds = trajectory.step_medians(rows)
    page = Path(run[0].folder).parent
    page = page.parent if several_lengths else page
    first, last = meds[1], meds[-1]
    return [f"**Over a training run** ([{trajectory.PAGE}]({_path(at, page, trajectory.PAGE)}"
            f")): {source}, checkpoints at steps "
            f"{', '.join(str(e.step) for e in run)}, N = {run[0].seq_len}. "
            f"{trajectory.verdict(rows)} From its first checkpoint to its last the median logit "
            f"std went from {_fig(first['logit_std'])} (step {first['step']}) to "
            f"{_fig(last['logit_std'])} (step {last['step']}), the median coherence from "
            f"{_fig(first['coherence'])} to {_fig(last['coherence'])}.", ""]


def _length_lines(at: str, source: str, entries: list, got: Mapping) -> list[str]:
    """One model at several lengths: its dispersing heads, per layer."""
    from attnscale.inspect import lengths
    from attnscale.inspect.records import median
    by_length = {e.seq_len: got[e] for e in sorted(entries, key=lambda e: e.seq_len)}
    rows = lengths.length_rows(by_length)
    fitted = [r for r in rows if r["fitted"]]
    layers = lengths.layer_summary(rows)
    windowed = [s["layer"] for s in layers if s["window"] is not None
                and s["lengths_fitted"] != rows[0]["lengths"]]
    sizes = sorted({len(s["dispersing"]) + len(s["holding"]) for s in layers} - {0})
    page = Path(entries[0].folder).parent
    return [f"**Against length**: [{source}]({_path(at, page, lengths.PAGE)}) at N = "
            f"{', '.join(map(str, by_length))}: {sum(bool(r['dispersing']) for r in fitted)} of "
            f"{len(fitted)} fitted heads disperse (entropy growing at least "
            f"{_fig(lengths.DISPERSING_SLOPE)} nats per unit ln n: what SSMax and log-n scaling "
            f"correct), median entropy slope {_fig(median(fitted, 'entropy_slope'))}; dispersing "
            f"heads per layer, of {'/'.join(map(str, sizes))} fitted"
            + (" (—: none fitted)" if any(not s["dispersing"] and not s["holding"]
                                          for s in layers) else "") + ": "
            + " ".join(str(len(s["dispersing"])) if s["dispersing"] or s["holding"] else "—"
                       for s in layers) + "."
            + (f" Layers {', '.join(map(str, windowed))} attend a sliding window: their keys "
               "stop growing at it, and they are fitted only over the lengths below it."
               if windowed else ""), ""]


def _extension(root: Path) -> list[str]:
    """A link to the extension study of a real checkpoint (``attnscale study extension``) with
    its claims, read from its store; nothing when the folder has none."""
    from attnscale.study.extend import page_section
    return page_section(root / EXTENSION)


def _steps_text(row: dict | None) -> str:
    """Mean steps to smoothed loss 0.1 over the seeds that got there, ``(k/n)`` when only k of
    n did, ``never`` when none did."""
    if row is None:
        return ""
    if row["steps_to_loss_0_1_mean"] is None:
        return "never"
    text = f"{row['steps_to_loss_0_1_mean']:.0f}"
    return text + (f" ({row['reached_0_1']}/{row['seeds']})"
                   if row["reached_0_1"] < row["seeds"] else "")


def _lm_setup(lm: dict) -> str:
    if not lm:
        return ""
    c = lm["records"][0]["config"]
    seeds = {}
    for r in lm["sensitivity"]:
        seeds.setdefault(r["width"], set()).add(r["seeds"])
    per_width = ", ".join(f"width {w}: {_seeds(max(s))}" for w, s in sorted(seeds.items()))
    device = str(c.get("device", "cpu")).split(":")[0] + (" bf16" if c.get("bf16") else
                                                          " float32")
    return (f"The LM columns come from a byte-level LM of {c['n_layers']} layers and "
            f"{c['n_heads']} heads, context {c['seq_len']}, {c['steps']} steps of batch "
            f"{c['batch_size']}, on {device} ({per_width}).  LR sensitivity is Wortsman et al. "
            "(2023)'s: the mean over the learning-rate grid of how far each final loss is from "
            "the best, in nats/byte, with the seed-to-seed [min, max]; lower is more robust.")


def _table(lm: dict, length: dict, recall: dict) -> list[str]:
    widths = lm.get("widths", [])
    sens = {(r["mechanism"], r["width"]): r for r in lm.get("sensitivity", [])}
    best = {(r["mechanism"], r["width"]): r for r in lm.get("highest", [])}
    names = list(lm.get("order", []))
    for extra in (length.get("recall", {}), length.get("lm", {}), recall.get("rows", {})):
        names += [m for m in extra if m not in names]
    head = ["mechanism", *[f"LR sensitivity, width {w}" for w in widths]]
    if widths:
        head += [f"highest LR that trains (width {' / '.join(map(str, widths))})",
                 "max attention logit there"]
    if length.get("recall"):
        head.append(f"recall accuracy at {RECALL_PAIRS} pairs "
                    f"(trained at {next(iter(length['recall'].values()))['train']})")
    if length.get("lm"):
        head.append(f"LM loss at {LM_CONTEXT_FACTOR}x the trained context "
                    f"({LM_CONTEXT_FACTOR * next(iter(length['lm'].values()))['train']})")
    if recall:
        head.append(f"recall study: steps to loss 0.1 at d_k {' / '.join(map(str, recall['d_k']))}")
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---|" * (len(head) - 1)]
    for m in names:
        cells = [m]
        for w in widths:
            r = sens.get((m, w))
            cells.append("" if r is None else lm_range_text(r))
        if widths:
            rows = [best.get((m, w)) for w in widths]
            cells.append(" / ".join("" if r is None else _lr_cell(r) for r in rows)
                         if any(rows) else "")
            cells.append(" / ".join("" if r is None or r["peak_logit"] is None
                                    else f"{r['peak_logit']:.1f}" for r in rows)
                         if any(rows) else "")
        if length.get("recall"):
            cells.append(_spread_text(length["recall"].get(m)))
        if length.get("lm"):
            cells.append(_spread_text(length["lm"].get(m)))
        if recall:
            got = recall["rows"].get(m, {})
            cells.append(" / ".join(_steps_text(got.get(d)) for d in recall["d_k"])
                         if got else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _seeds(n: int) -> str:
    return f"{n} seed" + ("s" if n != 1 else "")


def _ranked(values: Mapping[str, dict], lower: bool) -> list[tuple[str, dict]]:
    got = [(m, s) for m, s in values.items() if s.get("mean") is not None]
    return sorted(got, key=lambda x: x[1]["mean"], reverse=not lower)


def _against(values: Mapping[str, dict], name: str, ref: str, lower: bool) -> str:
    """How ``name``'s seed range compares with ``ref``'s, in words."""
    if ref not in values or name == ref:
        return ""
    outcome = claim_rules.compare(values[name], values[ref])
    good = "lower" if lower else "higher"
    if outcome == good:
        return f"its seed range is clear of {ref}'s"
    if outcome == "overlap":
        return f"its seed range overlaps {ref}'s"
    return f"it is on the wrong side of {ref}"


def _best_of(label: str, values: Mapping[str, dict], lower: bool) -> str:
    """``- label for A x; B y; C z (scaled w); for A, <its range against scaled's>.``"""
    top = _ranked(values, lower=lower)[:3]
    text = "; ".join(f"{m} {_spread_text(s)}" for m, s in top)
    how = _against(values, top[0][0], "scaled", lower=lower) if top else ""
    ref = f" (scaled {_spread_text(values['scaled'])})" \
        if "scaled" in values and "scaled" not in dict(top) else ""
    return f"- {label} for {text}{ref}" + (f"; for {top[0][0]}, {how}." if how else ".")


def _answer(lm: dict, length: dict) -> list[str]:
    """The short answer: the best mechanisms on each axis the studies measure, each against
    ``scaled`` with the seed ranges, in words the numbers decide."""
    out = []
    rows = lm.get("sensitivity", [])
    seeds = max((r["seeds"] for r in rows), default=0)
    if seeds:
        widths = sorted({r["width"] for r in rows if r["seeds"] == seeds})
        w = widths[-1]
        # only the cells with every seed, so that each number in the ranking is alike
        values = {r["mechanism"]: r for r in rows if r["width"] == w and r["seeds"] == seeds
                  and r["mean"] is not None}
        top = _ranked(values, lower=True)[:3]
        text = "; ".join(f"{m} {lm_range_text(s)}" for m, s in top)
        ref = values.get("scaled")
        tail = f" against scaled's {lm_range_text(ref)}" \
            if ref and "scaled" not in dict(top) else ""
        lead = top[0][0] if top else None
        how = _against(values, lead, "scaled", lower=True) if lead and seeds > 1 else \
            "one seed, so no seed range to compare" if lead and "scaled" in values else ""
        out.append(f"- **Learning-rate robustness** (width {w}, {_seeds(seeds)}, the widest width "
                   f"with the most seeds): lowest LR sensitivity for {text}{tail}"
                   + (f"; for {lead}, {how}." if how else "."))
    if length.get("recall"):
        out.append(_best_of(f"**Recall beyond the trained length** ({RECALL_PAIRS} pairs): "
                            "highest accuracy", length["recall"], lower=False))
    if length.get("lm"):
        out.append(_best_of(f"**LM loss at {LM_CONTEXT_FACTOR}x the trained context**: lowest",
                            length["lm"], lower=True))
    return out


def _verdicts(lm: dict, length: dict) -> list[str]:
    lines = []
    if lm:
        rows = lm["sensitivity"]
        per_width = {}
        for r in rows:
            per_width.setdefault(r["width"], []).append(r["seeds"])
        lines.append("The LM study's claims rest on " + ", ".join(
            f"width {w} with {_seeds(max(n))}" if min(n) == max(n) else
            f"width {w} with {min(n)}–{max(n)} seeds per variant (not every variant has "
            "finished)" for w, n in sorted(per_width.items())) + ".")
        lines.append("")
        for c in lm["claims"]:
            lines.append(f"- **{c['claim']}** {_verdict_word(c['verdict'])}. Expected: "
                         f"{c['expected']}. Measured: {c['measured']}.")
        lines.append("")
    if length:
        for c in length["claims"]:
            interval = f" {with_interval(c['ours'], c['ci'], '{:.4g}')}" \
                if c.get("ours") is not None and c.get("ci") else ""
            lines.append(f"- **{c['quantity']}**: {_verdict_word(c['verdict'])}. Expected: "
                         f"{c['expected']}. Measured:{interval}"
                         + (f"; {c['note']}" if c.get("note") else "") + ".")
        lines.append("")
    return lines


def _verdict_word(verdict: str) -> str:
    """The verdict as the page states it: agrees, differs (and why), inconclusive or not run."""
    return verdict[:1].upper() + verdict[1:] if verdict else ""


def render(root: str | os.PathLike) -> str:
    """The page's markdown, drawn from the study folders under ``root``."""
    loaded = load(root)
    lm = _lm_tables(loaded.get("lm"))
    length = _length_tables(loaded.get("length"))
    recall = _recall_tables(loaded.get("recall"))
    lines = ["# Which temperature mechanism should my model use?", "",
             "Measured by attnscale's studies, every number read from the stores in this folder "
             "by `attnscale results` (redraw any study with `attnscale study NAME --from NAME`). "
             "Numbers are the mean over seeds with the seed-to-seed [min, max].", "",
             "## The studies", "", *_evidence(loaded), "", *_checkpoints(Path(root)),
             *_extension(Path(root))]
    answer = _answer(lm, length)
    if answer:
        lines += ["## The short answer", "", *answer, "",
                  "These are small models trained briefly on one CPU corpus: they rank mechanisms "
                  "on the temperature questions, not on final quality at scale.", ""]
        if lm:
            # Re-running one seed of the LM study with another build of the same kernels left
            # the final losses within 2e-4 up to lr 0.003 but moved them by up to 0.08 nats at
            # lr 0.1: near divergence, rounding matters about as much as the seed.
            lines += ["At the highest learning rates a final loss also moves with float rounding "
                      "(another build of the same kernels, another summation order) by about as "
                      "much as it moves between seeds, so there the seed ranges understate the "
                      "uncertainty.", ""]
    if lm or length or recall:
        lines += ["## Per mechanism", ""]
        setup = _lm_setup(lm)
        if setup:
            lines += [setup, ""]
        within = next((r["within"] for r in lm.get("highest", [])), None)
        trains = "" if within is None else (
            f"The highest LR that trains: the largest whose final loss (mean over seeds) is "
            f"within {within:.0%} of the best over the grid, no seed diverging; the max "
            "attention logit is the peak over training at that LR.  ")
        lines += [trains + "A blank cell: the mechanism is not in that study.", "",
                  *_table(lm, length, recall), ""]
        if recall:
            w = recall["worst"]
            if w["accuracy_min"] >= RECALL_SOLVED:
                lines += [f"In the recall study ({_seeds(recall['seeds'])} per cell) every "
                          f"mechanism reaches at least {100 * w['accuracy_min']:.1f}% held-out "
                          f"accuracy at every d_k (the lowest seed: {w['mechanism']} at d_k "
                          f"{w['d_k']}), so its column is how fast each one learns the task.", ""]
            else:
                short = sorted({(r["mechanism"], r["d_k"]) for r in recall["all"]
                                if r["accuracy_min"] < RECALL_SOLVED})
                lines += [f"In the recall study ({_seeds(recall['seeds'])} per cell) a seed stays "
                          f"below {RECALL_SOLVED:.0%} held-out accuracy for "
                          + ", ".join(f"{m} at d_k {d}" for m, d in short)
                          + " (see recall/fragment.md); the column is how fast each learns.", ""]
    verdicts = _verdicts(lm, length)
    if verdicts:
        lines += ["## The claims, one by one", "", *verdicts]
    from attnscale.study import get
    shown = [(s, f, t) for s in STUDY_FOLDERS for f, t in get(s).page_figures.items()
             if (Path(root) / s / f).is_file()]
    if shown:
        lines += ["## Figures", ""]
        for s, f, t in shown:
            lines += [f"![{t}]({s}/{f})", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def write(root: str | os.PathLike, *, force: bool = False) -> Path:
    """Write ``root/README.md`` (refusing a file attnscale did not write unless ``force``)."""
    from attnscale.io import atomic_write, check_output_path
    folder = check_root(root)
    check_output_path("DIR", folder / PAGE, kind="file", force=force)
    text = render(folder)
    return atomic_write(folder / PAGE, text, param="DIR", force=force)


def stale(root: str | os.PathLike) -> bool:
    """Whether ``root/README.md`` differs from what the stores draw now."""
    path = Path(root) / PAGE
    return not path.is_file() or path.read_text(encoding="utf-8") != render(root)


def check_root(root: str | os.PathLike | None, param: str = "DIR") -> Path:
    """``root`` as a folder that exists; '' and a missing folder are errors naming ``param``."""
    if root is None or not str(root).strip():
        raise ConfigError(f"{param} must be a path, got {str(root or '')!r}.")
    path = Path(root)
    if not path.is_dir():
        raise ConfigError(f"{param} {str(root)!r} is not a folder.")
    return path


def studies_in(root: str | os.PathLike) -> Sequence[str]:
    """The study folders of :data:`STUDY_FOLDERS` that ``root`` holds (each marked, or found, as
    its study's), without reading their stores."""
    from attnscale.study.launcher import owner
    return [name for name in STUDY_FOLDERS
            if (Path(root) / name).is_dir() and owner(Path(root) / name) == name]
