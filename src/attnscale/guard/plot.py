"""The picture of a guard log: per layer, the max logit and the entropy over training steps.

One row of panels per layer.  Left: every head's ``logit_max`` over the recorded steps, one thin
line per head, on a log scale (logits at or below :data:`LOG_FLOOR` are drawn at it).  Right: the
heads' mean entropy as a band from the lowest to the highest head, with the lowest head (the min
over heads) as a line, on the fixed scale [0, ln n] (n = ``n_keys``, the most keys a query sees:
uniform attention at the top, one-hot at 0), so panels compare across layers and runs.  Alarms are
marked with a cross where they fired: max-logit alarms on the left, entropy alarms on the right.
Several runs (logs) share the panels, one colour each.
"""

from __future__ import annotations

import math

from attnscale.errors import ConfigError

# Logits at or below this are drawn at it on the log scale.
LOG_FLOOR = 1e-2
_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _by(records: list[dict], *keys: str) -> dict:
    out: dict = {}
    for r in records:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def plot_guard(runs: dict[str, list[dict]]):
    """A matplotlib Figure of ``runs`` (label -> guard records), described in the module doc;
    save it with :func:`attnscale.plotting.save`."""
    from attnscale.plotting import new_grid

    if not runs or not all(runs.values()):
        raise ConfigError("plot_guard needs at least one run with records.")
    layers = sorted({r["layer"] for records in runs.values() for r in records})
    fig, axes = new_grid(len(layers), 2, 10, 2.6 * len(layers) + 0.6)
    n_keys = max(r["n_keys"] for records in runs.values() for r in records)
    top = math.log(max(n_keys, 2))
    for (label, records), colour in zip(runs.items(), _COLOURS * 8):
        for row, layer in enumerate(layers):
            mine = [r for r in records if r["layer"] == layer]
            left, right = axes[row]
            for (head,), rows in sorted(_by(mine, "head").items()):
                rows.sort(key=lambda r: r["step"])
                left.plot([r["step"] for r in rows],
                          [max(r["logit_max"], LOG_FLOOR) for r in rows], color=colour,
                          lw=0.8, alpha=0.7, label=label if head == 0 else None)
            steps = sorted(_by(mine, "step").items())
            xs = [s for (s,), _ in steps]
            lo = [min(r["entropy_mean"] for r in rows) for _, rows in steps]
            hi = [max(r["entropy_mean"] for r in rows) for _, rows in steps]
            right.fill_between(xs, lo, hi, color=colour, alpha=0.25, lw=0)
            right.plot(xs, lo, color=colour, lw=1.2, label=f"{label}: lowest head")
            for r in mine:
                fired = r["alarm"].split(",") if r["alarm"] else []
                if "max_logit" in fired:
                    left.plot(r["step"], max(r["logit_max"], LOG_FLOOR), "x", color="black",
                              ms=5)
                if "entropy_floor" in fired or "entropy_collapse" in fired:
                    right.plot(r["step"], r["entropy_mean"], "x", color="black", ms=5)
    for row, layer in enumerate(layers):
        left, right = axes[row]
        left.set_yscale("log")
        left.set_ylabel(f"layer {layer}\nmax logit")
        right.set_ylim(0.0, top * 1.02)
        right.axhline(top, color="grey", lw=0.6, ls=":")
        right.set_ylabel(f"mean entropy (nats)\n0 to ln {n_keys} = {top:.3g}")
        if row == 0:
            left.set_title("max pre-softmax logit per head (x: alarm)")
            right.set_title("mean entropy, band over heads (x: alarm)")
            left.legend(fontsize=7, loc="upper left")
            right.legend(fontsize=7, loc="lower left")
        if row == len(layers) - 1:
            left.set_xlabel("step")
            right.set_xlabel("step")
    fig.tight_layout()
    return fig
