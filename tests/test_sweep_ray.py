"""The Ray executor for real: a local Ray instance gives the local executor's results, failing
trials are recorded, a lost chunk of batched trials falls back to single trials, and on a
two-node cluster a node removed mid-sweep costs no trial."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

import sweep_batch_experiments
import sweep_experiments
from sweep_experiments import wait_until
from attnscale import sweep
from attnscale.sweep import ray_exec
from attnscale.sweep.ray_exec import GCS_WAIT_VARIABLE, LOCAL_GCS_WAIT

TESTS = Path(__file__).resolve().parent
SAT_GRID = {"mechanism": ["scaled", "qk-layernorm"], "d_k": [4, 32]}
SAT_FIXED = {"n": 32, "trials": 100}


def _ray_environment(patch: pytest.MonkeyPatch, ray_home: Path) -> None:
    """Ray's worker processes find attnscale and the test experiments through PYTHONPATH; HOME
    is :func:`ray_home`; none of the user's cluster settings apply."""
    paths = [str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]
    patch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    patch.setenv("HOME", str(ray_home))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS",
                 GCS_WAIT_VARIABLE):
        patch.delenv(name, raising=False)


@pytest.fixture
def importable(monkeypatch, ray_home):
    """A test that starts (and stops) Ray itself, in :func:`_ray_environment`."""
    _ray_environment(monkeypatch, ray_home)
    assert not ray.is_initialized()
    yield
    ray.shutdown()


@pytest.fixture(scope="class")
def joined(ray_home):
    """One local Ray instance for a class of tests, started as ``--ray`` starts one
    (:func:`ray_exec.connected`): a start costs seconds, and its workers, once they have
    imported attnscale, serve every test of the class.  A sweep run in the class joins it and
    leaves it running."""
    with pytest.MonkeyPatch.context() as patch:
        _ray_environment(patch, ray_home)
        assert not ray.is_initialized()
        with ray_exec.connected("local"):
            yield
    assert not ray.is_initialized()


def _results(res) -> dict[str, str]:
    return {r["trial"]: json.dumps(r["result"]) for r in res}


def test_ray_gives_the_local_executor_results(tmp_path, importable):
    on_ray = sweep.run("saturation", SAT_GRID, tmp_path / "ray", fixed=SAT_FIXED,
                       ray_address="local")
    assert not ray.is_initialized()             # the instance it started is stopped
    local = sweep.run("saturation", SAT_GRID, tmp_path / "local", fixed=SAT_FIXED, workers=2)
    assert on_ray.complete and len(on_ray) == 4
    assert _results(on_ray) == _results(local)


@pytest.mark.usefixtures("joined")
class TestOnOneRayInstance:
    """Sweeps on one local Ray instance, started once for the class (:func:`joined`)."""

    def test_ray_records_a_raising_and_a_crashed_trial(self, cli, tmp_path, monkeypatch):
        monkeypatch.setattr(ray_exec, "MAX_RETRIES", 1)  # each retry a worker started again
        marks = tmp_path / "marks"
        marks.mkdir()
        (marks / "fail-1").touch()
        (marks / "kill-2").touch()
        out = tmp_path / "s"
        code, _, err = cli("sweep", "test-marked", "--grid", "x=0,1,2,3", "--set",
                           f"marks={marks}", "--out", str(out), "--ray")
        assert code == 1, err
        res = sweep.load(out)
        status = {r["config"]["x"]: r["status"] for r in res}
        assert status == {0: "ok", 1: "error", 2: "error", 3: "ok"}
        errors = {r["config"]["x"]: r["error"].split("\n", 1)[0] for r in res.failed}
        assert errors[1] == "RuntimeError: trial x=1 was asked to fail"
        assert errors[2].startswith("WorkerCrashedError")
        # an exception is not retried; a crashed worker is, MAX_RETRIES times
        assert sweep_experiments.runs(marks) == {0: 1, 1: 1, 2: 1 + ray_exec.MAX_RETRIES, 3: 1}

    def test_ray_runs_chunks_and_a_lost_chunk_falls_back_to_single_trials(self, tmp_path,
                                                                           monkeypatch):
        # One retry instead of ray_exec's three: each retry of the doomed trial is a worker
        # process killed and started again (seconds each), and one shows the fallback as well.
        monkeypatch.setattr(ray_exec, "MAX_RETRIES", 1)
        MAX_RETRIES = ray_exec.MAX_RETRIES
        marks = tmp_path / "marks"
        marks.mkdir()
        (marks / "kill-3").touch()
        res = sweep.run("test-batched", {"x": list(range(6))}, tmp_path / "s",
                        fixed={"marks": str(marks)}, ray_address="local")
        assert ray.is_initialized()                # joined, not started: left running
        assert {r["config"]["x"] for r in res.failed} == {3}
        assert res.failed[0]["error"].startswith("WorkerCrashedError")
        calls = Counter(sweep_batch_experiments.calls(marks))
        lost = next(c for c in calls if 3 in c and len(c) > 1)   # the chunk: tried, retried, lost
        assert calls[lost] == 1 + MAX_RETRIES and calls[(3,)] == 1 + MAX_RETRIES
        assert all(calls[(x,)] == 1 for x in lost if x != 3)      # then each of its trials alone
        reference = sweep.run("test-batched", {"x": [x for x in range(6) if x != 3]},
                              tmp_path / "ref", fixed={"marks": str(marks), "group": -1},
                              workers=1)
        assert sorted(_results(res.ok).values()) == sorted(_results(reference).values())


def test_a_local_start_waits_longer_for_its_gcs_and_restores_the_environment(monkeypatch):
    from attnscale.sweep.ray_exec import _gcs_wait
    monkeypatch.delenv(GCS_WAIT_VARIABLE, raising=False)
    with _gcs_wait("local"):
        assert os.environ[GCS_WAIT_VARIABLE] == str(LOCAL_GCS_WAIT)
    assert GCS_WAIT_VARIABLE not in os.environ
    with _gcs_wait("auto"):                      # joining: no GCS of ours to wait for
        assert GCS_WAIT_VARIABLE not in os.environ
    monkeypatch.setenv(GCS_WAIT_VARIABLE, "7")   # the user's value is kept
    with _gcs_wait("local"):
        assert os.environ[GCS_WAIT_VARIABLE] == "7"
    assert os.environ[GCS_WAIT_VARIABLE] == "7"


def test_a_node_lost_mid_sweep_costs_no_trial(tmp_path, importable, monkeypatch):
    """Every trial is gated (see sweep_experiments), so the first two hold the only CPU of each
    node.  The node is removed while its trial runs, and the gate opens only once that trial's
    process is gone: exactly that trial runs twice (Ray's retry, on the other node), every other
    trial once, and the sweep completes.  No step depends on timing."""
    monkeypatch.setenv(GCS_WAIT_VARIABLE, str(LOCAL_GCS_WAIT))   # as a local start has it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # head runs no task
    try:
        doomed = cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        marks, out = tmp_path / "marks", tmp_path / "s"
        marks.mkdir()
        lost: list[int] = []
        failures: list[BaseException] = []
        sweep_over = threading.Event()   # the sweep returned: stop waiting for trials to start

        def remove_the_node_under_its_trial():
            try:
                wait_until(lambda: len(sweep_experiments.held(marks)) >= 2 or sweep_over.is_set(),
                           "a trial running on each node")
                held = sweep_experiments.held(marks)
                on_doomed = [x for x, (_, node) in held.items() if node == doomed.node_id]
                assert len(held) == 2 and len(on_doomed) == 1, (held, doomed.node_id)
                lost.append(on_doomed[0])
                pid = held[on_doomed[0]][0]
                cluster.remove_node(doomed)   # takes the trial running on it down with it
                wait_until(lambda: sweep_experiments.gone(pid), "the removed node's trial gone")
            except BaseException as err:  # reported by the test, after the sweep
                failures.append(err)
            finally:
                (marks / "go-all").touch()   # never leave the sweep waiting

        remover = threading.Thread(target=remove_the_node_under_its_trial)
        remover.start()
        grid = {"x": list(range(8))}
        try:
            res = sweep.run("test-marked", grid, out, fixed={"marks": str(marks), "gate": True},
                            ray_address=cluster.address)
        finally:
            sweep_over.set()
            remover.join()
        if failures:
            raise failures[0]
        assert res.complete and sorted(r["config"]["x"] for r in res) == grid["x"]
        assert sweep_experiments.runs(marks) == {x: 1 + (x in lost) for x in grid["x"]}
        assert len(lost) == 1
    finally:
        ray.shutdown()
        cluster.shutdown()
