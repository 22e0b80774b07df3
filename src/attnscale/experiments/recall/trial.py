"""The ``recall`` experiment: one associative-recall training run as a sweep trial.

Its parameters are the fields of :class:`~attnscale.experiments.recall.config.RecallConfig`, with
the same defaults.  The result is everything the run measured except its wall time (the record
carries that), so it is the same bytes on any executor; :func:`run_result` rebuilds the
:class:`~attnscale.experiments.recall.trainer.RunResult` from a record, for tables and figures
drawn from a store.

Trials that share every setting but mechanism, seed and options (:func:`shared_key`) run together
when the executor chunks them: :func:`recall_batch` trains them as one batched model
(:func:`~attnscale.experiments.recall.trainer.train_runs`), which gives each run the same bytes
as training it alone (``tests/test_sweep_batch.py`` checks every mechanism) at a lower cost per
run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from attnscale.experiments.recall.config import RecallConfig, shared_key
from attnscale.experiments.recall.trainer import TRAIN_THREADS, RunResult, train, train_runs
from attnscale.experiments.registry import Param, experiment, params_from_dataclass
from attnscale.mechanisms import canonical_options


def _check(config: dict) -> None:
    RecallConfig(**config).validated()


def _batch_key(config: dict) -> tuple:
    return shared_key(RecallConfig(**config))


def recall_batch(configs: Sequence[dict]) -> list[dict]:
    """:func:`recall_run` of each config, trained as one batched model (same results)."""
    runs = train_runs([RecallConfig(**c) for c in configs], show_progress=False)
    return [trial_result(run) for run in runs]


def _canonical_options(options: dict, settings: Mapping[str, list]) -> dict:
    """A run's options typed by the sweep's mechanisms (``{"cap": 20}`` is ``{"cap": 20.0}``)."""
    return canonical_options(settings.get("mechanism", ()), options)


def _params() -> dict[str, Param]:
    params = params_from_dataclass(RecallConfig)
    return {**params, "options": dataclasses.replace(params["options"],
                                                      canonical=_canonical_options)}


@experiment("recall", params=_params(), check=_check,
            threads=TRAIN_THREADS, batch_key=_batch_key, run_batch=recall_batch)
def recall_run(**config) -> dict:
    """Train one recall model (RecallConfig fields) and return its measurements: milestones,
    final loss, held-out accuracy and statistics, step-0 gradients, plateaus, the per-step loss
    and the attention-statistics trace."""
    return trial_result(train(RecallConfig(**config), show_progress=False))


def trial_result(run: RunResult) -> dict:
    """The record's result: :meth:`RunResult.record`, every measurement but the wall time."""
    return run.record()


def run_result(record: dict) -> RunResult:
    """The :class:`RunResult` of an ``ok`` record of this experiment."""
    return RunResult.from_record(RecallConfig(**record["config"]), record["result"],
                                 record["wall_seconds"])
