"""The ``saturation`` experiment: one Monte Carlo cell of :func:`attnscale.saturation` (one
mechanism at one d_k) as a sweep trial.  It lives on the experiments floor, above the
measurement it wraps (:mod:`attnscale.measure.montecarlo` knows nothing of the registry).

The cell's draws are seeded per ``(seed, d_k, n)`` and shared by the mechanisms sampled the same
way, so a cell run alone equals the same row of a multi-mechanism ``saturation`` call.
"""

from __future__ import annotations

from attnscale.errors import check_int
from attnscale.experiments.registry import experiment
from attnscale.measure.montecarlo import ESSAY_N, ESSAY_TRIALS, check_mechanisms, saturation


def _check(config: dict) -> None:
    """The checks :func:`saturation` makes on entry, made up front for every cell of a grid."""
    for key, minimum in (("d_k", 1), ("n", 1), ("trials", 2), ("seed", 0)):
        check_int(key, config[key], minimum=minimum)
    check_mechanisms([config["mechanism"]])


@experiment("saturation", check=_check, threads=1)
def saturation_cell(*, mechanism: str, d_k: int, n: int = ESSAY_N, trials: int = ESSAY_TRIALS,
                    seed: int = 0) -> dict:
    """Softmax saturation of one mechanism over n random keys at one d_k: the mean and standard
    error of max weight, entropy (nats), softmax-Jacobian norm and logit std over ``trials``."""
    (row,) = saturation([d_k], n, trials, seed, [mechanism], show_progress=False)
    return row
