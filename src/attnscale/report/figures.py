"""Plotting helpers shared by the report sections (matplotlib, Agg backend, no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from attnscale.constants import Z95  # noqa: E402

# One colour per mechanism, shared by every figure: the essay draws scaled blue, unscaled green.
MECHANISM_COLORS = {"scaled": "tab:blue", "unscaled": "tab:green"}


def color_for(mechanism: str, index: int) -> str:
    """The fixed colour of ``mechanism``, or the ``index``-th of matplotlib's cycle."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return MECHANISM_COLORS.get(mechanism, cycle[(index + 3) % len(cycle)])


def plot_vs_dk(ax, rows: Sequence[dict], stat: str, mechanisms: Sequence[str]) -> None:
    """Plot ``<stat>_mean`` against ``d_k`` (log2 axis), one line per mechanism, 95% CI band."""
    for i, mech in enumerate(mechanisms):
        rs = sorted((r for r in rows if r["mechanism"] == mech), key=lambda r: r["d_k"])
        x = [r["d_k"] for r in rs]
        y = [r[f"{stat}_mean"] for r in rs]
        se = [r[f"{stat}_se"] for r in rs]
        c = color_for(mech, i)
        ax.plot(x, y, "o-", color=c, label=mech, ms=4)
        ax.fill_between(x, [a - Z95 * b for a, b in zip(y, se)],
                        [a + Z95 * b for a, b in zip(y, se)], color=c, alpha=0.2, lw=0)
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
