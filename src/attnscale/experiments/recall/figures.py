"""Figures of the recall runs: loss curves (Figure 3).

Plotting takes the records the experiments return and draws on matplotlib axes; files are saved
with :func:`attnscale.plotting.save`.  The recall study's heat maps are
:func:`attnscale.study.recall.figure`.
"""

from __future__ import annotations

from collections.abc import Sequence

from attnscale.experiments.recall import metrics
from attnscale.experiments.recall.trainer import RunResult
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
