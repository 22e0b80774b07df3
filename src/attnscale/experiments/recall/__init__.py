"""The essay's associative-recall training demo ("A Training Demo"), made fast and reproducible.

* :mod:`~attnscale.experiments.recall.task`: the data stream and the held-out set;
* :mod:`~attnscale.experiments.recall.model`: the single-head model and its batched, table-projected forward;
* :mod:`~attnscale.experiments.recall.trainer`: training and per-run measurements;
* :mod:`~attnscale.experiments.recall.metrics`: smoothing, milestones, plateaus;
* :mod:`~attnscale.experiments.recall.experiments`: the essay's numbers and the all-mechanism study;
* :mod:`~attnscale.experiments.recall.figures`, :mod:`~attnscale.experiments.recall.outputs`: plots and result files.
"""

from __future__ import annotations

from attnscale.experiments.recall.config import RecallConfig
from attnscale.experiments.recall.trainer import RunResult, compare, run_all, train, train_runs
from attnscale.experiments.recall.experiments import study  # noqa: E402  (experiments imports trainer)

__all__ = ["RecallConfig", "RunResult", "compare", "run_all", "study", "train", "train_runs"]
