"""One seed aggregation for every study and for the report: a value measured once per seed
becomes its mean, sample standard deviation and seed-to-seed range."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def finite(values: Sequence[float | None]) -> list[float]:
    """The seeds' values that were measured: None, NaN and infinite (a milestone never reached,
    a diverged run) left out."""
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def spread(values: Sequence[float | None]) -> dict:
    """Mean, sample std (ddof 1; 0 for one seed), min and max over the seeds with a
    :func:`finite` value, ``n`` of them, and ``missing``: the seeds without one.  With no finite
    value every statistic is None.  The standard error of the mean is
    :func:`attnscale.stats.mean_se` over the same values."""
    got = finite(values)
    if not got:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0,
                "missing": len(values)}
    std = float(np.std(got, ddof=1)) if len(got) > 1 else 0.0
    return {"mean": float(np.mean(got)), "std": std, "min": min(got), "max": max(got),
            "n": len(got), "missing": len(values) - len(got)}

