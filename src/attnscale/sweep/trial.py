"""One trial: its id, and running it in whichever process the executor chose.

A trial's id is a stable hash of its experiment name and full config in canonical JSON (sorted
keys, no spaces), so the same config has the same id in every run, on every machine, whatever the
grid order.  :func:`run_trial` is the one function every executor calls in its worker: it sets the
torch thread count, calls the experiment and turns any exception into an ``error`` outcome, so
that only a dead process, never a failing trial, can stop a worker.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

from attnscale.experiments import registry
from attnscale.workers import num_threads

# Hex digits of the trial id: 64 bits, so a collision within any sweep is negligible.
ID_CHARS = 16


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, strict (no NaN): equal configs give equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def trial_id(experiment: str, config: dict) -> str:
    """Stable id of ``config`` under ``experiment``: a prefix of SHA-256 of its canonical JSON."""
    text = canonical_json({"experiment": experiment, "config": config})
    return hashlib.sha256(text.encode()).hexdigest()[:ID_CHARS]


@dataclass(frozen=True)
class Trial:
    id: str
    config: dict


@dataclass(frozen=True)
class Task:
    """What a worker needs to run a trial: the experiment, the module that registers it, the
    config, and the thread count when the experiment leaves it to the executor."""
    trial: str
    experiment: str
    module: str
    config: dict
    threads: int


def error_text(err: BaseException) -> str:
    """``Type: message`` on one line, then the traceback."""
    line = " ".join(f"{type(err).__name__}: {err}".split())
    return line + "\n" + "".join(traceback.format_exception(err)).rstrip()


def outcome(task: Task, status: str, result: Any, error: str | None, wall: float) -> dict:
    """The record fields a worker reports back (the driver adds the config)."""
    return {"trial": task.trial, "status": status, "result": result, "error": error,
            "wall_seconds": wall, "host": socket.gethostname()}


def experiment_for(task: Task) -> registry.Experiment:
    """The experiment ``task`` runs, importing the module that registers it if needed."""
    if task.experiment not in registry.EXPERIMENTS:
        importlib.import_module(task.module)
    return registry.get(task.experiment)


def strict_json(experiment: str, result: Any) -> str:
    """``result`` as strict JSON text (no NaN or infinity); a TypeError naming the experiment
    otherwise."""
    try:
        return json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise TypeError(f"the result of experiment {experiment!r} is not strict JSON "
                        f"({err})") from None


def run_trial(task: Task) -> dict:
    """Run one trial in this process and return its outcome; never raises for a failing trial.

    The result must be JSON without NaN or infinity (experiments write ``None`` for a diverged
    number); it is round-tripped through JSON here so every executor returns the same values.
    """
    start = time.perf_counter()
    try:
        exp = experiment_for(task)
        with num_threads(exp.threads or task.threads):
            text = strict_json(task.experiment, exp.fn(**task.config))
        return outcome(task, "ok", json.loads(text), None, time.perf_counter() - start)
    except Exception as err:  # a failing trial is a result, not a crash of the sweep
        return outcome(task, "error", None, error_text(err), time.perf_counter() - start)
