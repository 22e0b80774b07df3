"""Curve metrics: EMA smoothing, milestones, plateaus, separation of two curves, power-law fits.

All functions are pure and take plain sequences or 1-D tensors of per-step values, so they can be
tested on synthetic curves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


# Smoothed loss s_t = EMA_DECAY * s_{t-1} + (1 - EMA_DECAY) * loss_t, started at s_0 = loss_0.
# 0.98 averages over ~50 steps (1 / (1 - 0.98)): enough to read a milestone off a noisy batch loss,
# short enough that the lag stays well below the essay's milestone gaps (~200 steps).
EMA_DECAY = 0.98
# The essay's loss milestones: "crossed smoothed loss 1.0 ... and 0.1".
MILESTONES = (1.0, 0.1)

# Plateau detection on the smoothed loss (see :func:`plateaus`).
PLATEAU_WINDOW = 50          # steps over which the relative drop is measured
PLATEAU_MAX_DROP = 0.10      # "flat": the smoothed loss falls by less than 10% per window
PLATEAU_MIN_STEPS = 100      # a stall shorter than this is noise, not a plateau
PLATEAU_ESCAPE = 0.5         # ... and it counts only if the loss then falls below half its level
PLATEAU_ESCAPE_STEPS = 200   # ... within this many steps of its end (a stall, not a slow tail)

# Two curves "separate" at the first step where they differ by more than this relative amount.
SEPARATION_REL = 0.01


def ema(values: Sequence[float], decay: float = EMA_DECAY) -> np.ndarray:
    """Exponential moving average ``s_t = decay s_{t-1} + (1 - decay) x_t`` with ``s_0 = x_0``."""
    x = np.asarray(values, dtype=np.float64)
    out = np.empty_like(x)
    acc = x[0] if len(x) else 0.0
    for t, v in enumerate(x):
        acc = decay * acc + (1.0 - decay) * v if t else v
        out[t] = acc
    return out


def first_below(curve: Sequence[float], threshold: float) -> int | None:
    """First step ``t`` with ``curve[t] < threshold``, or None if it never gets there."""
    hits = np.flatnonzero(np.asarray(curve) < threshold)
    return int(hits[0]) if len(hits) else None


def plateaus(smoothed: Sequence[float], *, window: int = PLATEAU_WINDOW,
             max_drop: float = PLATEAU_MAX_DROP, min_steps: int = PLATEAU_MIN_STEPS,
             escape: float = PLATEAU_ESCAPE, escape_steps: int = PLATEAU_ESCAPE_STEPS) -> list[dict]:
    """Stalls of a smoothed loss curve that training later escapes.

    A step t is *flat* when ``s[t + window] > (1 - max_drop) s[t]``: the loss falls by less than
    ``max_drop`` over the next ``window`` steps.  Flat steps closer than ``window`` are joined into
    one stretch ``[start, end]``, with ``end = last flat step + window``.  A stretch is a plateau if
    it lasts at least ``min_steps`` and the loss then falls below ``escape`` times its level within
    ``escape_steps`` of its end.  The last clause separates a stall, which training leaves quickly,
    from a slow tail near convergence, which is flat because there is little left to learn.

    Returns ``[{"start", "end", "level"}]`` with ``level`` the median smoothed loss over the span.
    """
    s = np.asarray(smoothed, dtype=np.float64)
    n = len(s) - window
    if n <= 0:
        return []
    flat = np.flatnonzero(s[window:] > (1.0 - max_drop) * s[:n])            # flat steps
    if len(flat) == 0:
        return []
    breaks = np.flatnonzero(np.diff(flat) > window)                          # gaps between stretches
    starts = np.concatenate([flat[:1], flat[breaks + 1]])
    lasts = np.concatenate([flat[breaks], flat[-1:]])
    out = []
    for start, last in zip(starts.tolist(), lasts.tolist()):
        end = last + window
        level = float(np.median(s[start:end + 1]))
        after = s[end:end + escape_steps + 1]
        if end - start >= min_steps and after.min() < escape * level:
            out.append({"start": start, "end": end, "level": level})
    return out


def separation_step(a: Sequence[float], b: Sequence[float], rel: float = SEPARATION_REL) -> int | None:
    """First step where ``|a - b| > rel * |b|``: where curve ``a`` leaves reference ``b``."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return first_below(-(np.abs(a - b) - rel * np.abs(b)), 0.0)


def max_rel_gap(a: Sequence[float], b: Sequence[float]) -> float:
    """``max_t |a_t - b_t| / |b_t|``, how closely ``a`` tracks ``b``."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def power_law_exponent(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x``: the a in ``y ~ x^a``."""
    lx = np.log(np.asarray(x, dtype=np.float64))
    ly = np.log(np.asarray(y, dtype=np.float64))
    return float(np.polyfit(lx, ly, 1)[0])
