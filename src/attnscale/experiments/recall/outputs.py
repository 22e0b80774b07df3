"""Result files of the recall study, written all or nothing through :mod:`attnscale.io` (staged,
atomic, and only over files attnscale wrote)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from attnscale.io import check_output_path, json_safe, staged_dir
from attnscale.experiments.recall.experiments import study_summary
from attnscale.experiments.recall.figures import study_figure
from attnscale.experiments.recall.trainer import RunResult, config_dict
from attnscale.report.figures import save
from attnscale.report.include import FRAGMENT_JSON, FRAGMENT_MD

# File names written by :func:`write_study` into its output directory.  The markdown and the
# title follow the study-folder contract of :mod:`attnscale.report.include`, so a finished study
# is added to the essay's report with ``attnscale reproduce --include DIR``.
STUDY_FILES = {"json": "study_recall.json", "markdown": FRAGMENT_MD, "title": FRAGMENT_JSON,
               "figure": "study_recall.png"}
STUDY_TITLE = "Every mechanism on associative recall"


def study_markdown(rows: Sequence[dict]) -> str:
    """Markdown fragment: steps to smoothed loss 0.1 and accuracy per mechanism x d_k."""
    mechanisms = list(dict.fromkeys(r["mechanism"] for r in rows))
    d_ks = sorted({r["d_k"] for r in rows})
    cell = {(r["mechanism"], r["d_k"]): r for r in rows}
    seeds = max(r["seeds"] for r in rows)
    head = "| mechanism | " + " | ".join(f"d_k={d}" for d in d_ks) + " |"
    rule = "|---|" + "---|" * len(d_ks)

    def steps(r: dict) -> str:
        if r["steps_to_loss_0_1_mean"] is None:
            return "never"
        text = f"{r['steps_to_loss_0_1_mean']:.0f} ± {r['steps_to_loss_0_1_std']:.0f}"
        return text + (f" ({r['reached_0_1']}/{r['seeds']})" if r["reached_0_1"] < r["seeds"]
                       else "")

    def acc(r: dict) -> str:
        return f"{100 * r['accuracy_mean']:.1f}% (min {100 * r['accuracy_min']:.1f}%)"

    lines = [f"Every registered mechanism on the associative-recall task, {seeds} seeds per cell, "
             "identical init and data per seed.", "",
             "**Steps to smoothed loss 0.1** (mean ± std over the seeds that got there; "
             "(k/n) when only k of n did):", "", head, rule]
    lines += [f"| {m} | " + " | ".join(steps(cell[m, d]) if (m, d) in cell else "" for d in d_ks)
              + " |" for m in mechanisms]
    lines += ["", "**Held-out accuracy** (mean over seeds, and the worst seed):", "", head, rule]
    lines += [f"| {m} | " + " | ".join(acc(cell[m, d]) if (m, d) in cell else "" for d in d_ks)
              + " |" for m in mechanisms]
    lines += ["", f"![Steps to loss 0.1 and accuracy per mechanism and d_k]({STUDY_FILES['figure']})"]
    return "\n".join(lines) + "\n"


def write_study(out_dir: str | os.PathLike, runs: Sequence[RunResult], *,
                force: bool = False) -> dict:
    """Write the study's JSON (summary rows and per-run rows), markdown fragment and figure.

    Returns ``{"summary": [...], "runs": [...], "files": {...}}``.
    """
    out_dir = check_output_path("--out", out_dir, kind="dir", files=STUDY_FILES.values(),
                                force=force)
    summary = study_summary(runs)
    shared = {k: v for k, v in config_dict(runs[0].config).items()
              if k not in ("mechanism", "seed", "d_k", "options")}  # what the grid varies
    result = json_safe({"config": shared, "summary": summary,
                                "runs": [{**r.row(), "config": config_dict(r.config)}
                                         for r in runs]})
    with staged_dir(out_dir, force=force) as staging:
        (staging / STUDY_FILES["json"]).write_text(json.dumps(result, indent=1, allow_nan=False),
                                                   encoding="utf-8")
        (staging / STUDY_FILES["markdown"]).write_text(study_markdown(summary), encoding="utf-8")
        (staging / STUDY_FILES["title"]).write_text(json.dumps({"title": STUDY_TITLE}),
                                                    encoding="utf-8")
        save(study_figure(summary), staging / STUDY_FILES["figure"])
    return {**result, "files": {k: str(out_dir / v) for k, v in STUDY_FILES.items()}}
