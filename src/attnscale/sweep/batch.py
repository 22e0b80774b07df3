"""Running compatible trials together: chunks planned in the driver, run in one worker call.

An experiment that registers ``batch_key`` and ``run_batch`` (see
:mod:`attnscale.experiments.registry`) may have several pending trials executed by one call, e.g.
the ``recall`` runs of one d_k trained as one batched model.  The engine still sees trials: each
keeps its id, its record (written as soon as its chunk finishes) and its own error.

Planning (:func:`chunks`): trials are grouped by key, and each group is dealt round-robin into
``slots`` chunks, ``slots`` being the trials the executor runs at once (local workers, or the Ray
cluster's CPUs over each trial's share), or a multiple of ``slots`` so that no chunk holds more
than :data:`MAX_CHUNK` trials (and never more chunks than trials).  So every worker gets a share
of every group: a group alone keeps all workers busy, and with groups of different cost (a
study's d_k) each worker gets about the same mix; chunks go out group by group, in the grid's
order.

Faults (:func:`run_chunk`, and the executors): a chunk whose ``run_batch`` raises, or returns
anything but one strict-JSON result per trial, is run again one trial at a time in the same
worker, so a bad trial is recorded as its own error and the others still finish; a chunk whose
worker dies (or whose Ray task is lost more often than Ray retries it) goes back to the queue as
single trials.  A chunk's wall time is shared equally among its trials' records.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Hashable, Sequence

from attnscale.sweep.trial import Task, experiment_for, outcome, run_trial, strict_json
from attnscale.workers import num_threads

Chunk = tuple[Task, ...]

# Most trials in one chunk.  A chunk is in flight as a whole, so this bounds what an interrupt
# loses and the memory of one call (a recall chunk is one batched model); the default recall
# study's chunks (a d_k's 3 seeds of every mechanism, up to 96 runs, over 2 workers) stay whole.
MAX_CHUNK = 48


def chunks(tasks: Sequence[Task], slots: int,
           key: Callable[[Task], Hashable | None] | None) -> list[Chunk]:
    """``tasks`` as chunks to run together (module docstring); ``key`` None: one trial each."""
    if key is None or slots < 1:
        return [(t,) for t in tasks]
    out: list[Chunk] = []
    groups: dict[Hashable, list[Task]] = {}
    for task in tasks:
        k = key(task)
        if k is None:
            out.append((task,))
        else:
            groups.setdefault(k, []).append(task)
    for members in groups.values():
        n = min(len(members), slots * -(-len(members) // (slots * MAX_CHUNK)))
        out += [tuple(members[i::n]) for i in range(n)]
    return out


def run_chunk(chunk: Chunk) -> list[dict]:
    """Run ``chunk`` in this process, one outcome per trial in order; never raises for a failing
    trial.  One trial runs as :func:`run_trial` does; several through ``run_batch``, falling back
    to one at a time when that fails."""
    if len(chunk) == 1:
        return [run_trial(chunk[0])]
    first = chunk[0]
    start = time.perf_counter()
    try:
        exp = experiment_for(first)
        with num_threads(exp.threads or first.threads):
            results = list(exp.run_batch([dict(t.config) for t in chunk]))
        if len(results) != len(chunk):
            raise ValueError(f"run_batch of {first.experiment!r} gave {len(results)} results "
                             f"for {len(chunk)} configs")
        texts = [strict_json(first.experiment, r) for r in results]
    except Exception:  # each trial alone then reports its own error, if any
        texts = None
    if texts is None:
        return [run_trial(t) for t in chunk]
    wall = (time.perf_counter() - start) / len(chunk)
    return [outcome(t, "ok", json.loads(text), None, wall) for t, text in zip(chunk, texts)]
