"""Plotting helpers shared by the report sections (matplotlib, Agg backend, no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from attnscale.constants import Z95  # noqa: E402
from attnscale.styles import style  # noqa: E402


def plot_vs_dk(ax, rows: Sequence[dict], stat: str, mechanisms: Sequence[str]) -> None:
    """Plot ``<stat>_mean`` against ``d_k`` (log2 axis), one line per mechanism in its own
    :func:`~attnscale.styles.style`, with its 95% CI band."""
    for mech in mechanisms:
        rs = sorted((r for r in rows if r["mechanism"] == mech), key=lambda r: r["d_k"])
        x = [r["d_k"] for r in rs]
        y = [r[f"{stat}_mean"] for r in rs]
        se = [r[f"{stat}_se"] for r in rs]
        line = style(mech)
        ax.plot(x, y, label=mech, ms=4, **line)
        ax.fill_between(x, [a - Z95 * b for a, b in zip(y, se)],
                        [a + Z95 * b for a, b in zip(y, se)], color=line["color"], alpha=0.2, lw=0)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("head dimension $d_k$")
    ax.grid(True, which="both", alpha=0.3)


def save(fig, path: Path) -> None:
    """Save ``fig`` as PNG and release it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    """A figure with ``ncols`` side-by-side axes."""
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])
