"""Trials run together (an experiment's ``batch_key`` and ``run_batch``): how pending trials are
dealt into chunks, that a chunk's trials keep their own records and results (the same bytes as
alone, for every recall mechanism), and the faults: a chunk that raises or whose worker dies
falls back to single trials, so only the bad trial is an error (on Ray: tests/test_sweep_ray.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import sweep_batch_experiments
from attnscale import sweep
from attnscale.experiments import registry
from attnscale.study.recall import D_KS as STUDY_D_KS, SEEDS as STUDY_SEEDS
from attnscale.experiments.recall.trial import recall_batch, recall_run
from attnscale.mechanisms import MECHANISMS
from attnscale.sweep.batch import MAX_CHUNK, chunks, run_chunk
from attnscale.sweep.trial import Task, run_trial

# Small runs: batched and alone must agree bit for bit at any size, and the recall study's own
# sizes (d_model 256, 96 sequences a step, 2000 held out) would only make each run slower.
RECALL_FIXED = {"steps": 20, "d_k": 16, "d_model": 64, "batch_size": 16, "eval_size": 64}


@pytest.fixture
def marks(tmp_path) -> Path:
    folder = tmp_path / "marks"
    folder.mkdir()
    return folder


def _tasks(configs: list[dict], experiment: str = "test-batched") -> list[Task]:
    module = registry.get(experiment).module
    return [Task(f"t{i}", experiment, module, c, 1) for i, c in enumerate(configs)]


def _by_group(task: Task):
    return registry.get("test-batched").batch_key(task.config)


def _results(res) -> dict[str, str]:
    return {r["trial"]: json.dumps(r["result"]) for r in res}


# ---------------------------------------------------------------------------------------------
# planning


def test_registry_wants_batch_key_and_run_batch_together():
    with pytest.raises(ValueError, match="give both or neither"):
        sweep.experiment("test-half-batched", batch_key=lambda c: 0)(lambda *, x=0: {})
    assert "test-half-batched" not in registry.EXPERIMENTS


def test_each_group_is_dealt_round_robin_into_one_chunk_per_slot(marks):
    configs = [{"x": x, "marks": str(marks), "group": x % 3 - 1} for x in range(12)]
    tasks = _tasks(configs)                  # group -1 (never batched), 0 and 1: four each
    planned = chunks(tasks, 3, _by_group)
    xs = [[t.config["x"] for t in c] for c in planned]
    assert xs == [[0], [3], [6], [9], [1, 10], [4], [7], [2, 11], [5], [8]]
    assert sorted(t.trial for c in planned for t in c) == sorted(t.trial for t in tasks)
    assert chunks(tasks, 3, None) == [(t,) for t in tasks]          # no batch key: one each
    assert [len(c) for c in chunks(tasks[1::3], 8, _by_group)] == [1, 1, 1, 1]  # slots > group


def test_no_chunk_holds_more_than_max_chunk_trials(marks):
    many = _tasks([{"x": x, "marks": str(marks), "group": 0} for x in range(2 * MAX_CHUNK + 1)])
    sizes = [len(c) for c in chunks(many, 2, _by_group)]
    assert len(sizes) == 4 and max(sizes) <= MAX_CHUNK and sum(sizes) == len(many)
    assert [len(c) for c in chunks(many[:2 * MAX_CHUNK], 2, _by_group)] == [MAX_CHUNK] * 2


def test_the_default_recall_study_keeps_two_workers_equally_loaded():
    """Every mechanism x 4 d_k x 3 seeds on 2 workers: each d_k (a batch key of its own) splits
    into an even number of chunks (two, or more once a d_k's runs exceed two chunks of
    MAX_CHUNK) whose sizes differ by at most one, each mechanism's seeds dealt to as many chunks
    as it has seeds, so each worker gets half of every d_k."""
    exp = registry.get("recall")
    configs = [exp.config({"mechanism": m, "d_k": d, "seed": s})
               for d in STUDY_D_KS for m in MECHANISMS for s in STUDY_SEEDS]
    planned = chunks(_tasks(configs, "recall"), 2, lambda t: exp.batch_key(t.config))
    per_d_k = len(MECHANISMS) * len(STUDY_SEEDS)
    n = 2 * -(-per_d_k // (2 * MAX_CHUNK))
    assert len(planned) == n * len(STUDY_D_KS)
    for i in range(0, len(planned), n):
        group = planned[i:i + n]
        assert len({t.config["d_k"] for c in group for t in c}) == 1
        assert max(map(len, group)) - min(map(len, group)) <= 1 <= min(map(len, group))
        for m in MECHANISMS:
            spread = Counter(j for j, c in enumerate(group) for t in c
                             if t.config["mechanism"] == m)
            assert max(spread.values()) == 1 if len(STUDY_SEEDS) <= n else \
                max(spread.values()) - min(spread.values()) <= 1


# ---------------------------------------------------------------------------------------------
# one call, several trials


def test_a_chunk_gives_each_trial_its_result_alone(marks):
    tasks = _tasks([{"x": x, "marks": str(marks), "group": 0} for x in range(4)])
    together = run_chunk(tuple(tasks))
    alone = [run_trial(t) for t in tasks]
    assert sweep_batch_experiments.calls(marks) == [(0, 1, 2, 3), (0,), (1,), (2,), (3,)]
    assert [o["trial"] for o in together] == [t.trial for t in tasks]
    assert [o["status"] for o in together] == ["ok"] * 4
    assert [o["result"] for o in together] == [o["result"] for o in alone]


def test_a_raising_chunk_runs_its_trials_one_at_a_time(marks):
    (marks / "fail-2").touch()
    tasks = _tasks([{"x": x, "marks": str(marks), "group": 0} for x in range(4)])
    outs = run_chunk(tuple(tasks))
    assert sweep_batch_experiments.calls(marks) == [(0, 1, 2, 3), (0,), (1,), (2,), (3,)]
    assert [o["status"] for o in outs] == ["ok", "ok", "error", "ok"]
    assert outs[2]["error"].startswith("RuntimeError: trial x=2 was asked to fail\nTraceback")


def test_recall_batched_is_bit_identical_to_alone_for_every_mechanism():
    exp = registry.get("recall")
    configs = [exp.config({**RECALL_FIXED, "mechanism": m, "seed": s})
               for m in MECHANISMS for s in (0, 1)]
    assert len({exp.batch_key(c) for c in configs}) == 1       # all may share one model
    together = recall_batch(configs)
    assert len(together) == len(configs)
    for config, result in zip(configs, together):
        alone = recall_run(**config)
        assert json.dumps(result) == json.dumps(alone), (config["mechanism"], config["seed"])
    few = recall_batch(configs[3:6])                           # another chunk, the same bytes
    assert [json.dumps(r) for r in few] == [json.dumps(r) for r in together[3:6]]


def test_recall_keys_separate_runs_that_cannot_share_a_model():
    exp = registry.get("recall")
    base = exp.config(RECALL_FIXED)
    key = exp.batch_key
    assert key(base) == key({**base, "mechanism": "unscaled", "seed": 2})
    assert key(base) != key({**base, "d_k": 64})
    assert key(base) != key({**base, "lr": base["lr"] * 2})


# ---------------------------------------------------------------------------------------------
# the engine: chunks on workers, one record per trial, faults


def test_a_batched_sweep_records_every_trial_as_run_alone(tmp_path, marks):
    grid = {"x": list(range(8)), "group": [0, 1]}
    res = sweep.run("test-batched", grid, tmp_path / "s", fixed={"marks": str(marks)},
                    workers=2)
    assert res.complete and len(res) == 16
    calls = sweep_batch_experiments.calls(marks)
    assert sorted(len(c) for c in calls) == [4, 4, 4, 4]      # 2 groups x 2 workers
    assert all(r["wall_seconds"] >= 0 for r in res)
    reference = sweep.run("test-batched", {"x": list(range(8)), "group": [-1, -2]},
                          tmp_path / "ref", fixed={"marks": str(marks)}, workers=1)
    assert [len(c) for c in sweep_batch_experiments.calls(marks)[4:]] == [1] * 16
    assert sorted(_results(res).values()) == sorted(_results(reference).values())


def test_a_raising_trial_and_a_killed_worker_in_chunks_cost_only_themselves(tmp_path, marks):
    out = tmp_path / "s"
    (marks / "fail-1").touch()
    (marks / "kill-6").touch()
    res = sweep.run("test-batched", {"x": list(range(8))}, out, fixed={"marks": str(marks)},
                    workers=2)
    status = {r["config"]["x"]: r["status"] for r in res}
    assert status == {x: "error" if x in (1, 6) else "ok" for x in range(8)}
    errors = {r["config"]["x"]: r["error"].split("\n", 1)[0] for r in res.failed}
    assert errors[1] == "RuntimeError: trial x=1 was asked to fail"
    assert errors[6].startswith("WorkerDied:") and "SIGKILL" in errors[6]
    calls = Counter(x for c in sweep_batch_experiments.calls(marks) for x in c)
    assert calls == {x: 2 for x in range(8)}                   # in its chunk, then alone

    (marks / "fail-1").unlink()
    (marks / "kill-6").unlink()
    done = sweep.resume(out, workers=2, retry_errors=True)
    assert done.complete
    assert sorted(sweep_batch_experiments.calls(marks)[-2:]) == [(1,), (6,)]  # one per worker
    reference = sweep.run("test-batched", {"x": list(range(8))}, tmp_path / "ref",
                          fixed={"marks": str(marks), "group": -1}, workers=1)
    assert sorted(_results(done).values()) == sorted(_results(reference).values())


def test_recall_on_two_workers_in_chunks_gives_the_results_of_single_runs(tmp_path):
    grid = {"mechanism": ["scaled", "unscaled", "qk-clip", "sigma-reparam"], "seed": [0]}
    res = sweep.run("recall", grid, tmp_path / "s", fixed=RECALL_FIXED, workers=2)
    assert res.complete
    alone = {r["trial"]: json.dumps(recall_run(**r["config"])) for r in res}
    assert _results(res) == alone

