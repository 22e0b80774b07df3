"""The essay's associative-recall training demo ("A Training Demo"), made fast and reproducible.

* :mod:`~attnscale.recall.task`: the data stream and the held-out set;
* :mod:`~attnscale.recall.model`: the single-head model and its batched, table-projected forward;
* :mod:`~attnscale.recall.trainer`: training and per-run measurements;
* :mod:`~attnscale.recall.metrics`: smoothing, milestones, plateaus;
* :mod:`~attnscale.recall.experiments`: the essay's numbers and the all-mechanism study;
* :mod:`~attnscale.recall.figures`, :mod:`~attnscale.recall.outputs`: plots and result files.
"""

from __future__ import annotations

from attnscale.recall.config import RecallConfig
from attnscale.recall.trainer import RunResult, compare, run_all, train, train_runs
from attnscale.recall.experiments import study  # noqa: E402  (experiments imports trainer)

__all__ = ["RecallConfig", "RunResult", "compare", "run_all", "study", "train", "train_runs"]
