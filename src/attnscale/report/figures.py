"""Plotting helpers of the report sections; :func:`new_figure` and :func:`save` live in
:mod:`attnscale.plotting`, the floor the experiments and studies share."""

from __future__ import annotations

from collections.abc import Sequence

from attnscale.constants import Z95
from attnscale.plotting import new_figure, save  # noqa: F401  (the sections' helpers)
from attnscale.styles import style


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
