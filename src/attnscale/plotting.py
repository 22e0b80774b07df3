"""Figure helpers shared by the experiments, the studies and the report (matplotlib, Agg backend,
no display).  A floor below all three, so that none of them imports another for a figure."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, path: Path) -> None:
    """Save ``fig`` as PNG and release it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    """A figure with ``ncols`` side-by-side axes."""
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def new_grid(nrows: int, ncols: int, width: float, height: float):
    """A ``width`` x ``height`` inch figure with ``nrows`` x ``ncols`` axes: ``axes[row][col]``."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False)
    return fig, [list(row) for row in axes]
