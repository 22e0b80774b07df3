"""Figures of the recall study: loss curves (Figure 3) and the all-mechanism study grid.

Plotting takes the records the experiments return and draws on matplotlib axes; files are saved
with :func:`attnscale.report.figures.save`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from attnscale.experiments.recall import metrics
from attnscale.experiments.recall.trainer import RunResult
from attnscale.report.figures import new_figure
from attnscale.styles import style

# Loss curves have one point per step: mark every tenth of the axis so the marker names the line.
MARKEVERY = 0.1


def plot_loss_curves(ax, runs: Sequence[RunResult], *, mark_milestones: bool = True) -> None:
    """Smoothed training loss against step, log y, each mechanism in its own
    :func:`~attnscale.styles.style`.

    The first run of each mechanism is drawn bold, further seeds thin and faint.  Milestone
    crossings (smoothed loss 1.0 and 0.1) are marked with hollow dots, plateaus with a shaded band.
    """
    seen: set[str] = set()
    for r in runs:
        line = style(r.mechanism, markevery=MARKEVERY, ms=4)
        color = line["color"]
        first = r.mechanism not in seen
        seen.add(r.mechanism)
        if not first:
            line.update(marker="None")   # further seeds: thin and faint, no markers
        ax.plot(r.smoothed, lw=1.6 if first else 0.8, alpha=1.0 if first else 0.35,
                label=r.mechanism if first else None, **line)
        if not first:
            continue
        if mark_milestones:
            for level, step in zip(metrics.MILESTONES, (r.steps_to_loss_1, r.steps_to_loss_0_1)):
                if step is not None:
                    ax.plot([step], [r.smoothed[step]], "o", color=color, ms=6, mfc="white")
        for p in r.plateaus:
            ax.axvspan(p["start"], p["end"], color=color, alpha=0.08, lw=0)
    for level in metrics.MILESTONES:
        ax.axhline(level, color="0.6", lw=0.6, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"smoothed training loss (EMA {metrics.EMA_DECAY})")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend()


def study_figure(rows: Sequence[dict]):
    """Two heat maps, mechanism x d_k: mean steps to smoothed loss 0.1 and mean eval accuracy."""
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
