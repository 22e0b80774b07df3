"""One seed aggregation for every study and for the report: a value measured once per seed
becomes its mean, sample standard deviation and seed-to-seed range."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def spread(values: Sequence[float | None]) -> dict:
    """Mean, sample std (ddof 1; 0 for one seed), min and max over the seeds with a finite value,
    ``n`` of them, and ``missing``: the seeds without one (None, NaN or infinite: a milestone
    never reached, a diverged run).  With no finite value every statistic is None."""
    got = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not got:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0,
                "missing": len(values)}
    std = float(np.std(got, ddof=1)) if len(got) > 1 else 0.0
    return {"mean": float(np.mean(got)), "std": std, "min": min(got), "max": max(got),
            "n": len(got), "missing": len(values) - len(got)}


def standard_error(s: dict) -> float | None:
    """The standard error of a :func:`spread`'s mean, std / √n; None for fewer than two seeds."""
    return s["std"] / math.sqrt(s["n"]) if s["n"] > 1 else None
