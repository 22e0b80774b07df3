"""The essay's associative-recall training demo ("A Training Demo"), made fast and reproducible.

* :mod:`~attnscale.experiments.recall.task`: the data stream and the held-out set;
* :mod:`~attnscale.experiments.recall.model`: the single-head model and its batched, table-projected forward;
* :mod:`~attnscale.experiments.recall.trainer`: training and per-run measurements;
* :mod:`~attnscale.experiments.recall.metrics`: smoothing, milestones, plateaus;
* :mod:`~attnscale.experiments.recall.experiments`: the essay's numbers (gradient split, logit
  scaling, init-reparam);
* :mod:`~attnscale.experiments.recall.figures`: loss curves (Figure 3).

The all-mechanism study is :mod:`attnscale.study.recall`, on the sweep engine.
"""

from __future__ import annotations

from attnscale.experiments.recall.config import RecallConfig
from attnscale.experiments.recall.trainer import RunResult, compare, run_all, train, train_runs

__all__ = ["RecallConfig", "RunResult", "compare", "run_all", "train", "train_runs"]
