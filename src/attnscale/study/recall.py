"""The recall study: every registered mechanism on the essay's associative-recall task, across
d_k and seeds (one ``recall`` store), drawn as a table of steps to loss 0.1 and accuracy and two
heat maps."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from attnscale.experiments.recall.config import OPTIMIZERS, RecallConfig
from attnscale.mechanisms import MECHANISMS, check_mechanism
from attnscale.study.registry import register
from attnscale.study.seeds import spread
from attnscale.study.spec import Analysis, Option, Study, Trials

# The study's grid: every mechanism x d_k in {16, 64, 256, 1024} x 3 seeds, at the demo's
# settings otherwise (RecallConfig's defaults).
D_KS = (16, 64, 256, 1024)
SEEDS = (0, 1, 2)
# --quick: every mechanism at the two smaller head sizes on one seed (a sixth of the runs, and
# the cheaper ones).
QUICK_D_KS, QUICK_SEEDS = D_KS[:2], SEEDS[:1]
DEFAULT = RecallConfig()
FIXED = ("pairs", "steps", "lr", "batch_size", "optimizer")   # the options a user may change
SUMMARY = "study_recall.json"
FIGURE = "study_recall.png"
SUMMARY_COLUMNS = ["mechanism", "d_k", "seeds", "steps_to_loss_0_1_mean", "steps_to_loss_0_1_std",
                   "reached_0_1", "accuracy_mean", "accuracy_min", "final_loss_mean"]


def every_mechanism() -> list[str]:
    """Every registered mechanism, read when the study starts."""
    return list(MECHANISMS)


def summary_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (mechanism, d_k): mean and spread over seeds of steps to 0.1 and accuracy."""
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["config"]["mechanism"], r["config"]["d_k"]), []).append(r["result"])
    rows = []
    for (mech, d_k), rs in cells.items():
        steps = spread([r["steps_to_loss_0_1"] for r in rs])
        acc = spread([r["eval_accuracy"] for r in rs])
        final = [math.nan if r["final_loss"] is None else r["final_loss"] for r in rs]
        rows.append({"mechanism": mech, "d_k": d_k, "seeds": len(rs),
                     "steps_to_loss_0_1_mean": steps["mean"], "steps_to_loss_0_1_std": steps["std"],
                     "reached_0_1": steps["n"], "accuracy_mean": acc["mean"],
                     "accuracy_min": acc["min"], "final_loss_mean": sum(final) / len(rs),
                     "qk_std_trained_mean": sum(r["eval_stats"]["qk_std"] for r in rs) / len(rs)})
    return rows


def markdown(rows: Sequence[dict]) -> str:
    """fragment.md: steps to smoothed loss 0.1 and accuracy per mechanism x d_k."""
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
    lines += ["", f"![Steps to loss 0.1 and accuracy per mechanism and d_k]({FIGURE})"]
    return "\n".join(lines) + "\n"


def figure(rows: Sequence[dict]):
    """Two heat maps, mechanism x d_k: mean steps to smoothed loss 0.1 and mean eval accuracy."""
    from attnscale.plotting import new_figure
    mechanisms = list(dict.fromkeys(r["mechanism"] for r in rows))
    d_ks = sorted({r["d_k"] for r in rows})
    cell = {(r["mechanism"], r["d_k"]): r for r in rows}
    fig, (ax_steps, ax_acc) = new_figure(2, width=0.9 * len(d_ks) + 3.2,
                                         height=0.32 * len(mechanisms) + 1.6)
    panels = ((ax_steps, "steps_to_loss_0_1_mean", "steps to loss 0.1 (mean over seeds)", "viridis"),
              (ax_acc, "accuracy_mean", "eval accuracy (mean over seeds)", "magma"))
    for ax, key, title, cmap in panels:
        grid = np.array([[_nan(cell.get((m, d), {}).get(key)) for d in d_ks] for m in mechanisms])
        image = ax.imshow(grid, aspect="auto", cmap=cmap)
        for i, m in enumerate(mechanisms):
            for j, d in enumerate(d_ks):
                # Both colour maps run dark to light: white text on the darker half.
                dark = not math.isnan(grid[i, j]) and image.norm(grid[i, j]) < 0.6
                ax.text(j, i, _cell_text(cell.get((m, d)), key), ha="center", va="center",
                        fontsize=7, color="w" if dark else "k")
        ax.set_xticks(range(len(d_ks)), [str(d) for d in d_ks])
        ax.set_yticks(range(len(mechanisms)), mechanisms)
        ax.set_xlabel("$d_k$")
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax)
    return fig


def _nan(x: float | None) -> float:
    return math.nan if x is None else float(x)


def _cell_text(row: dict | None, key: str) -> str:
    if row is None:
        return ""
    if key.startswith("steps"):
        if row["steps_to_loss_0_1_mean"] is None:
            return "never"
        miss = row["seeds"] - row["reached_0_1"]
        return f"{row['steps_to_loss_0_1_mean']:.0f}" + (f" ({miss} never)" if miss else "")
    return f"{100 * row[key]:.1f}%"


def analyse(stores: Mapping[str, list[dict]]) -> Analysis:
    """The summary table, the per-run rows and the heat maps (no claims: the study measures what
    the essay did not run)."""
    from attnscale.experiments.recall.trainer import config_dict
    from attnscale.experiments.recall.trial import run_result
    runs = [run_result(r) for r in stores["recall"]]
    rows = summary_rows(stores["recall"])
    shared = {k: v for k, v in config_dict(runs[0].config).items()
              if k not in ("mechanism", "seed", "d_k", "options")}  # what the grid varies
    tables = {"config": shared, "summary": rows,
              "runs": [{**r.row(), "config": config_dict(r.config)} for r in runs]}
    return Analysis(markdown(rows), [], tables, {FIGURE: lambda: figure(rows)},
                    table=rows, columns=SUMMARY_COLUMNS, printed={"rows": rows})


def _mechanism(name: str) -> str:
    return check_mechanism(name, param="--mechanisms")


STUDY = register(Study(
    name="recall",
    title="Every mechanism on associative recall",
    doc="Every registered mechanism on the essay's associative-recall task across d_k and seeds "
        "(identical init and data per seed; the runs of a d_k share one batched model per "
        "worker): steps to smoothed loss 0.1 and held-out accuracy.",
    stores={"recall": Trials("recall", {"mechanism": every_mechanism, "d_k": D_KS,
                                        "seed": SEEDS},
                             {k: getattr(DEFAULT, k) for k in FIXED})},
    quick={"recall": Trials("recall", {"mechanism": every_mechanism, "d_k": QUICK_D_KS,
                                       "seed": QUICK_SEEDS},
                            {k: getattr(DEFAULT, k) for k in FIXED})},
    quick_doc=f"every mechanism x d_k {', '.join(map(str, QUICK_D_KS))} x seed "
              f"{QUICK_SEEDS[0]}",
    analyse=analyse, summary=SUMMARY, figures=(FIGURE,),
    page_figures={FIGURE: "recall: steps to loss 0.1 and accuracy"},
    options=(
        Option("--mechanisms", "mechanism", "comma-separated mechanism names, or 'all'",
               check=_mechanism, every=every_mechanism),
        Option("--d-k", "d_k", "comma-separated head sizes d_k", aliases=("--dk",), minimum=1),
        Option("--seed", "seed", "comma-separated seeds", minimum=0),
        Option("--pairs", "pairs", f"key-value pairs per sequence, <= {DEFAULT.n_keys} key "
               "tokens", axis=False, minimum=1),
        Option("--steps", "steps", "optimiser steps", axis=False, minimum=1),
        Option("--lr", "lr", "learning rate", axis=False),
        Option("--batch-size", "batch_size", "sequences per step", axis=False, minimum=1),
        Option("--optimizer", "optimizer", "optimizer", axis=False, choices=OPTIMIZERS),
    ),
    examples="""
  attnscale study recall --out study/ --mechanisms scaled,unscaled,qknorm --d-k 16,64 --seed 0
  attnscale study recall --out /tmp/s --steps 300 --d-k 16 --seed 0 --json --workers 2
""",
))
