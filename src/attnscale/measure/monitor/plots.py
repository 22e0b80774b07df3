"""Summaries and figures of monitor records: one row per layer, the entropy heatmap."""

from __future__ import annotations

import math

from attnscale.columns import MONITOR_SUMMARIES
from attnscale.errors import ConfigError, check_int

def layer_summary(records: list[dict]) -> list[dict]:
    """One row per layer from per-head ``records``: head means of the means, min of the minima,
    max of the maxima, plus ``heads``.  Same keys as a record otherwise (no ``head``)."""
    by_layer: dict[int, list[dict]] = {}
    for r in records:
        by_layer.setdefault(r["layer"], []).append(r)
    rows = []
    for layer, heads in sorted(by_layer.items()):
        over = {"mean": lambda v: sum(v) / len(v), "min": min, "max": max}
        rows.append({"layer": layer, "module": heads[0]["module"], "heads": len(heads),
                     "queries": heads[0]["queries"],
                     **{s.key: over[s.reduce]([h[s.key] for h in heads])
                        for s in MONITOR_SUMMARIES if s.recorded}})
    return rows


def colour_limits(stat: str, n_keys: int | None = None) -> tuple[float, float] | None:
    """The fixed colour scale of ``stat`` in :func:`plot_entropy`: [0, ln N] for an entropy,
    [0, 1] for a weight, None (the data's range) for logit statistics."""
    if "entropy" in stat:
        if n_keys is None:
            raise ConfigError(f"plot_entropy needs n_keys (the most keys a query attends) to "
                              f"draw {stat} on the fixed scale [0, ln n_keys].")
        return 0.0, math.log(check_int("n_keys", n_keys, minimum=2))
    if "weight" in stat:
        return 0.0, 1.0
    return None


def plot_entropy(records: list[dict], ax, *, stat: str = "entropy_mean",
                 n_keys: int | None = None) -> None:
    """Heatmap of ``stat`` (default mean entropy, nats) per (layer, head) on matplotlib ``ax``.

    The colours use one fixed scale (:func:`colour_limits`), stated on the colour bar, so they
    compare across layers, models and runs: an entropy spans [0, ln n_keys], from one-hot to
    uniform over ``n_keys`` keys (the sequence length for self-attention); a weight spans [0, 1].
    """
    n_layers = 1 + max(r["layer"] for r in records)
    n_heads = 1 + max(r["head"] for r in records)
    grid = [[float("nan")] * n_heads for _ in range(n_layers)]
    for r in records:
        grid[r["layer"]][r["head"]] = r[stat]
    limits = colour_limits(stat, n_keys)
    vmin, vmax = limits if limits is not None else (None, None)
    image = ax.imshow(grid, aspect="auto", cmap="viridis", origin="upper", vmin=vmin, vmax=vmax)
    if "entropy" in stat:
        label = f"{stat} (nats), fixed scale 0 to ln {n_keys} = {vmax:.3g}"
    elif limits is not None:
        label = f"{stat}, fixed scale 0 to 1"
    else:
        label = stat
    bar = ax.figure.colorbar(image, ax=ax, label=label)
    bar.formatter.set_useOffset(False)  # an offset label would collide with the title
    bar.update_ticks()
    if n_layers * n_heads <= 256:  # small grids: print each value in its cell
        for r in records:
            ax.text(r["head"], r["layer"], f"{r[stat]:.3g}", ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    # Integer ticks; label every one while they stay legible.
    ax.set_xticks(range(0, n_heads, max(1, n_heads // 16)))
    ax.set_yticks(range(0, n_layers, max(1, n_layers // 32)))
