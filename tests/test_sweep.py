"""The sweep engine: registry and grids, trial ids, the store, resume, the local executor's
faults (a trial that raises, a worker that is killed, the driver interrupted or killed), and the
``attnscale sweep`` command with its bad inputs."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import sweep_experiments
from sweep_experiments import gone, wait_until
from attnscale import sweep
from attnscale.errors import ConfigError
from attnscale.io import LOCK, MANIFEST
from attnscale.experiments import registry
from attnscale.sweep.grid import SweepSpec, parse_fixed, parse_grid
from attnscale.sweep.local import threads_per_worker
from attnscale.sweep.store import RESULTS_FILE, SPEC_FILE
from attnscale.sweep.trial import Task, canonical_json, run_trial, trial_id
from children import sigint_default

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
SAT_GRID = {"mechanism": ["scaled", "ssmax"], "d_k": [4, 16]}
SAT_FIXED = {"n": 16, "trials": 50}


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]


def _results(out: Path) -> dict[str, str]:
    """trial id -> the exact JSON text of its result."""
    return {r["trial"]: json.dumps(r["result"]) for r in sweep.load(out)}


@pytest.fixture
def marks(tmp_path) -> Path:
    folder = tmp_path / "marks"
    folder.mkdir()
    return folder


# ---------------------------------------------------------------------------------------------
# registry, grids, trial ids


def test_registry_rejects_a_duplicate_name():
    with pytest.raises(ValueError, match="already registered"):
        @sweep.experiment("test-marked")
        def again(*, x: int) -> dict:
            return {}


def test_registry_refuses_an_unsupported_parameter_type():
    with pytest.raises(ValueError, match="not one of"):
        @sweep.experiment("test-bad-type")
        def bad(*, x: list) -> dict:
            return {}
    assert "test-bad-type" not in sweep.EXPERIMENTS


def test_builtin_experiments_declare_their_parameters():
    from attnscale.experiments.recall import RecallConfig
    from dataclasses import fields
    recall = registry.get("recall")
    assert list(recall.params) == [f.name for f in fields(RecallConfig)]
    assert recall.params["lr"].type is float and recall.params["options"].type is dict
    sat = registry.get("saturation")
    assert sat.params["mechanism"].required and sat.params["d_k"].required
    assert sat.params["n"].type is int and not sat.params["n"].required


def test_cli_values_are_typed_by_the_parameter():
    exp = registry.get("recall")
    grid = parse_grid(exp, ["lr=1e-3,3e-3", "seed=0,1", "mechanism=scaled,softcap",
                            'options=[{"cap": 30}, {}]'])
    assert grid == {"lr": [1e-3, 3e-3], "seed": [0, 1], "mechanism": ["scaled", "softcap"],
                    "options": [{"cap": 30}, {}]}
    assert parse_fixed(exp, ["steps=600", 'options={"cap": 5}']) == \
        {"steps": 600, "options": {"cap": 5}}
    # lr=1 and lr=1.0 are one value, hence one trial id
    assert parse_grid(exp, ["lr=1"])["lr"] == [1.0] and isinstance(
        parse_grid(exp, ["lr=1"])["lr"][0], float)


@pytest.mark.parametrize("items, message", [
    (["lr=1e-3,0.001"], "more than once"),
    (["seed=0,1,0"], "more than once"),
    (["seed="], "empty value"),
    (["seed=0,,1"], "empty value"),
    (["seed=1.5"], "seed must be an integer"),
    (["lr=fast"], "lr must be a number"),
    (["lr=nan"], "lr must be finite"),
    (["options={"], "options must be a JSON object"),
    (["seed=0", "seed=1"], "given twice"),
    (["sed=0"], "Did you mean: seed?"),
    (["seed"], "key=value"),
    (["options=[1]"], "options must be a JSON object"),
])
def test_bad_grid_values_name_the_key(items, message):
    with pytest.raises(ConfigError, match=message):
        parse_grid(registry.get("recall"), items)


def test_api_grid_takes_numpy_values_as_plain_numbers():
    import numpy as np
    spec = SweepSpec.build(registry.get("recall"),
                           {"seed": np.arange(2), "lr": np.array([1e-3, 1e-2])})
    assert spec.grid == {"seed": [0, 1], "lr": [1e-3, 1e-2]}
    assert [type(v) for v in (*spec.grid["seed"], *spec.grid["lr"])] == [int, int, float, float]


def test_api_grid_values_are_checked():
    with pytest.raises(ConfigError, match="grid seed must be a list"):
        SweepSpec.build(registry.get("recall"), {"seed": 3})
    with pytest.raises(ConfigError, match="grid seed must not be empty"):
        SweepSpec.build(registry.get("recall"), {"seed": []})
    with pytest.raises(ConfigError, match="seed must be an integer, got True"):
        SweepSpec.build(registry.get("recall"), {"seed": [True]})
    with pytest.raises(ConfigError, match="both in the grid and fixed"):
        SweepSpec.build(registry.get("recall"), {"seed": [0]}, {"seed": 1})
    with pytest.raises(ConfigError, match="needs d_k"):
        SweepSpec.build(registry.get("saturation"), {"mechanism": ["scaled"]})


def test_trial_id_is_a_hash_of_the_canonical_config():
    config = {"b": 1.0, "a": [1, 2], "c": {"y": 1, "x": "s"}}
    text = '{"config":{"a":[1,2],"b":1.0,"c":{"x":"s","y":1}},"experiment":"e"}'
    assert canonical_json({"experiment": "e", "config": config}) == text
    assert trial_id("e", config) == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert trial_id("e", dict(reversed(list(config.items())))) == trial_id("e", config)
    assert trial_id("f", config) != trial_id("e", config)


def test_trials_are_the_product_of_the_grid_over_the_base():
    exp = registry.get("saturation")
    spec = SweepSpec.build(exp, SAT_GRID, SAT_FIXED)
    trials = spec.trials()
    assert [(t.config["mechanism"], t.config["d_k"]) for t in trials] == \
        [("scaled", 4), ("scaled", 16), ("ssmax", 4), ("ssmax", 16)]
    assert all(t.config["seed"] == 0 and t.config["n"] == 16 for t in trials)
    # the order of grid keys changes the order of trials, not their ids
    other = SweepSpec.build(exp, {"d_k": [16, 4], "mechanism": ["ssmax", "scaled"]}, SAT_FIXED)
    assert {t.id for t in other.trials()} == {t.id for t in trials}


# ---------------------------------------------------------------------------------------------
# determinism


def test_a_result_does_not_depend_on_the_thread_count():
    for experiment, config in [
            ("saturation", {"mechanism": "qk-layernorm", "d_k": 32, "n": 64, "trials": 200,
                            "seed": 1}),
            ("recall", {**registry.get("recall").config({}), "d_k": 16, "steps": 30,
                        "eval_size": 50, "batch_size": 16})]:
        outs = [run_trial(Task("t", experiment, registry.get(experiment).module, config, n))
                for n in (1, 2)]
        assert [o["status"] for o in outs] == ["ok", "ok"], outs[0]["error"]
        assert json.dumps(outs[0]["result"]) == json.dumps(outs[1]["result"])


def test_results_are_the_same_bytes_on_one_or_two_workers(tmp_path):
    one = sweep.run("saturation", SAT_GRID, tmp_path / "one", fixed=SAT_FIXED, workers=1)
    two = sweep.run("saturation", SAT_GRID, tmp_path / "two", fixed=SAT_FIXED, workers=2)
    assert len(one) == len(two) == 4 and one.complete and two.complete
    assert _results(tmp_path / "one") == _results(tmp_path / "two")
    # a cell run alone is the row of the multi-mechanism Monte Carlo call
    from attnscale.measure.montecarlo import saturation
    rows = saturation([4, 16], 16, 50, 0, ["scaled", "ssmax"])
    got = {(r["config"]["mechanism"], r["config"]["d_k"]): r["result"] for r in one}
    assert all(got[row["mechanism"], row["d_k"]] == row for row in rows)


def test_workers_share_the_cores_when_the_experiment_leaves_threads_open(tmp_path):
    for workers in (1, 2):
        res = sweep.run("test-threads", {"x": [0, 1]}, tmp_path / f"w{workers}", workers=workers)
        assert {r["result"]["threads"] for r in res} == {threads_per_worker(workers)}


# ---------------------------------------------------------------------------------------------
# the store, resume and extend


def test_store_layout_and_load(tmp_path):
    out = tmp_path / "s"
    res = sweep.run("saturation", SAT_GRID, out, fixed=SAT_FIXED, workers=2)
    assert sorted(p.name for p in out.iterdir()) == [LOCK, MANIFEST, RESULTS_FILE, SPEC_FILE]
    spec = json.loads((out / SPEC_FILE).read_text())
    assert spec["experiment"] == "saturation" and spec["grid"] == SAT_GRID
    assert spec["fixed"] == SAT_FIXED and spec["base"] == {**SAT_FIXED, "seed": 0}
    lines = _lines(out)
    assert len(lines) == 4 and all(list(r) == ["trial", "config", "status", "result", "error",
                                               "wall_seconds", "host", "nulls"] for r in lines)
    assert all(r["trial"] == trial_id("saturation", r["config"]) for r in lines)
    frame = res.to_frame()
    assert list(frame["mechanism"]) == ["scaled", "scaled", "ssmax", "ssmax"]
    assert frame["status"].eq("ok").all() and "entropy_mean" in frame
    assert "result.mechanism" in frame  # a result key that clashes with a config key


def test_rerunning_the_same_sweep_runs_nothing_new(tmp_path, marks):
    out = tmp_path / "s"
    grid = {"x": [0, 1, 2]}
    sweep.run("test-marked", grid, out, fixed={"marks": str(marks)}, workers=2)
    again = sweep.run("test-marked", grid, out, fixed={"marks": str(marks)}, workers=2)
    assert again.complete and sweep_experiments.runs(marks) == {0: 1, 1: 1, 2: 1}
    with pytest.raises(ConfigError, match="already holds this sweep"):
        sweep.run("test-marked", grid, out, fixed={"marks": str(marks)}, resume=False)


def test_a_different_grid_is_refused_and_extend_runs_only_new_trials(tmp_path, marks):
    out = tmp_path / "s"
    fixed = {"marks": str(marks)}
    first = sweep.run("test-marked", {"x": [0, 1]}, out, fixed=fixed, workers=2)
    with pytest.raises(ConfigError, match=r"grid x: 0,1 -> 0,1,2.*extend"):
        sweep.run("test-marked", {"x": [0, 1, 2]}, out, fixed=fixed)
    with pytest.raises(ConfigError, match=r"setting sleep: 0.0 -> 0.5"):
        sweep.run("test-marked", {"x": [0, 1]}, out, fixed={**fixed, "sleep": 0.5})
    with pytest.raises(ConfigError, match="drops 1"):
        sweep.run("test-marked", {"x": [0, 2]}, out, fixed=fixed, extend=True)
    grown = sweep.run("test-marked", {"x": [0, 1, 2]}, out, fixed=fixed, extend=True, workers=2)
    assert grown.complete and len(grown) == 3
    assert sweep_experiments.runs(marks) == {0: 1, 1: 1, 2: 1}
    # a fixed setting may become a grid key that keeps its value: old trials keep their ids
    moved = sweep.resume(out, grid={"scale": [1.0, 2.0]}, extend=True, workers=2)
    assert len(moved) == 6 and sweep_experiments.runs(marks) == {0: 2, 1: 2, 2: 2}
    assert {r["trial"] for r in first} <= {r["trial"] for r in moved}
    with pytest.raises(ConfigError, match="must include the sweep's value 0.0"):
        sweep.resume(out, grid={"sleep": [0.1]}, extend=True)
    with pytest.raises(ConfigError, match=r"grid x: 0,1,2 -> 0,1,2,3.*extend=True"):
        sweep.resume(out, grid={"x": [0, 1, 2, 3]})


def test_a_torn_last_line_is_dropped_on_load_and_resume(tmp_path, marks):
    out = tmp_path / "s"
    fixed = {"marks": str(marks)}
    sweep.run("test-marked", {"x": [0, 1, 2]}, out, fixed=fixed, workers=1)
    lines = (out / RESULTS_FILE).read_bytes().splitlines(keepends=True)
    # the driver died while writing the last record: half a line, no newline
    (out / RESULTS_FILE).write_bytes(b"".join(lines[:2]) + lines[2][:40])
    loaded = sweep.load(out)
    assert len(loaded) == 2 and len(loaded.pending) == 1
    done = sweep.resume(out, workers=1)
    assert done.complete and len(_lines(out)) == 3
    assert (out / RESULTS_FILE).read_bytes().endswith(b"\n")


def test_an_edited_results_file_is_refused(tmp_path):
    out = tmp_path / "s"
    sweep.run("saturation", SAT_GRID, out, fixed=SAT_FIXED, workers=1)
    text = (out / RESULTS_FILE).read_text().splitlines()
    (out / RESULTS_FILE).write_text("\n".join([text[0], "not json", *text[1:]]) + "\n")
    with pytest.raises(ConfigError, match="line 2 is not a trial record"):
        sweep.load(out)


# ---------------------------------------------------------------------------------------------
# faults: a trial that raises, a worker that dies


def test_a_raising_trial_and_a_killed_worker_are_errors_and_retried_alone(tmp_path, marks):
    out = tmp_path / "s"
    (marks / "fail-2").touch()
    (marks / "kill-4").touch()
    res = sweep.run("test-marked", {"x": list(range(6))}, out, fixed={"marks": str(marks)},
                    workers=2)
    status = {r["config"]["x"]: r["status"] for r in res}
    assert status == {0: "ok", 1: "ok", 2: "error", 3: "ok", 4: "error", 5: "ok"}
    errors = {r["config"]["x"]: r["error"] for r in res.failed}
    assert errors[2].startswith("RuntimeError: trial x=2 was asked to fail\nTraceback")
    assert errors[4].startswith("WorkerDied:") and "SIGKILL" in errors[4].split("\n")[0]
    assert sweep_experiments.runs(marks) == dict.fromkeys(range(6), 1)

    (marks / "fail-2").unlink()
    (marks / "kill-4").unlink()
    assert len(sweep.resume(out, workers=2).failed) == 2        # errors kept without retry
    assert sweep_experiments.runs(marks) == dict.fromkeys(range(6), 1)
    done = sweep.resume(out, workers=2, retry_errors=True)
    assert done.complete
    assert sweep_experiments.runs(marks) == {0: 1, 1: 1, 2: 2, 3: 1, 4: 2, 5: 1}
    lines = _lines(out)                                          # compacted: one line per trial
    assert sorted(r["config"]["x"] for r in lines) == list(range(6))
    reference = sweep.run("test-marked", {"x": list(range(6))}, tmp_path / "ref",
                          fixed={"marks": str(marks)}, workers=1)
    assert {r["trial"]: r["result"] for r in done} == {r["trial"]: r["result"] for r in reference}


# ---------------------------------------------------------------------------------------------
# faults: the driver interrupted (SIGINT, SIGTERM) or killed (SIGKILL), then resumed


def _driver(*argv: str) -> subprocess.Popen:
    """``attnscale sweep ...`` in a child process that has the test experiments registered."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    code = "import sys, sweep_experiments; from attnscale.cli import main; sys.exit(main())"
    return subprocess.Popen([sys.executable, "-c", code, "sweep", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)


def _wait_for_lines(out: Path, count: int, proc: subprocess.Popen) -> None:
    path = out / RESULTS_FILE

    def written() -> bool:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return True
        assert proc.poll() is None, proc.communicate()
        return False

    wait_until(written, f"{count} records")


def _assert_all_gone(pids: set[int]) -> None:
    assert pids
    wait_until(lambda: all(gone(p) for p in pids),
               f"workers {sorted(p for p in pids if not gone(p))} gone")


def _stop(driver: subprocess.Popen, how: signal.Signals, marks: Path) -> None:
    """Stop the driver with ``how``; SIGINT exits 130 and SIGTERM 143, cleanly.  Either way no
    worker may outlive it."""
    driver.send_signal(how)
    if how == signal.SIGKILL:
        # Nothing can run in a SIGKILLed driver: the fork server dies with it, and the workers
        # with the fork server, even while their trials wait at closed gates.
        driver.wait(timeout=60)
        _assert_all_gone({pid for pid, _ in sweep_experiments.held(marks).values()})
    try:
        _, err = driver.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # a driver deaf to the signal must not outlive the test
        driver.kill()
        driver.communicate()
        raise
    if how == signal.SIGKILL:
        assert driver.returncode == -signal.SIGKILL
    elif how == signal.SIGTERM:
        assert driver.returncode == 143 and "terminated" in err and "Traceback" not in err
    else:
        assert driver.returncode == 130 and "interrupted" in err and "Traceback" not in err
    _assert_all_gone(sweep_experiments.pids(marks))


def test_interrupt_terminate_kill_then_resume_runs_every_trial_once(tmp_path, marks):
    """The trials are gated (see sweep_experiments): before each stop exactly one more trial is let
    through, so the driver is always stopped with trials running and others left, whatever the
    machine's load."""
    out = tmp_path / "s"
    grid = {"x": list(range(12))}
    fixed = {"marks": str(marks), "gate": True}
    driver = _driver("test-marked", "--grid", "x=" + ",".join(map(str, grid["x"])),
                     "--set", f"marks={marks}", "--set", "gate=true", "--out", str(out),
                     "--workers", "2")
    done = 0
    for how in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        recorded = {r["config"]["x"] for r in _lines(out)} if done else set()
        (marks / f"go-{min(set(grid['x']) - recorded)}").touch()
        _wait_for_lines(out, done + 1, driver)
        _stop(driver, how, marks)
        assert (out / RESULTS_FILE).read_bytes().endswith(b"\n")   # finished trials kept whole
        done = len(_lines(out))
        assert done < len(grid["x"])
        if how != signal.SIGKILL:
            driver = _driver("--resume", str(out), "--workers", "2")
    assert done == 3   # one trial let through per stage
    with open(out / RESULTS_FILE, "ab") as fh:   # as if killed in the middle of a record
        fh.write(b'{"trial": "0123')
    (marks / "go-all").touch()
    finished = sweep.resume(out, workers=2)
    assert finished.complete
    lines = _lines(out)
    assert sorted(r["config"]["x"] for r in lines) == grid["x"]          # each exactly once
    reference = sweep.run("test-marked", grid, tmp_path / "ref", fixed=fixed, workers=2)
    assert {r["trial"]: r["result"] for r in lines} == \
        {r["trial"]: r["result"] for r in reference}


# ---------------------------------------------------------------------------------------------
# the command line


def test_cli_runs_shows_and_resumes(cli, tmp_path):
    out = tmp_path / "s"
    args = ["sweep", "saturation", "--grid", "mechanism=scaled,ssmax", "--grid", "d_k=4,16",
            "--set", "n=16", "--set", "trials=50", "--out", str(out), "--workers", "2"]
    code, stdout, err = cli(*args)
    assert code == 0, err
    assert stdout.count(" ok ") == 4 and "saturation: 4 ok, 0 failed, 0 pending" in err
    code, stdout, _ = cli("sweep", "--show", str(out), "--json")
    shown = json.loads(stdout)
    assert code == 0 and (shown["ok"], shown["failed"], shown["pending"]) == (4, 0, 0)
    assert {t["trial"] for t in shown["trials"]} == set(_results(out))
    code, stdout, _ = cli("sweep", "--resume", str(out), "--extend", "--grid", "d_k=4,16,64",
                          "--json")
    assert code == 0 and json.loads(stdout)["ok"] == 6
    code, stdout, _ = cli("sweep", "--list", "--json")
    assert json.loads(stdout)["experiments"]["saturation"]["n"] == "int = 256"


def test_cli_show_lists_pending_and_failed_trials(cli, tmp_path, marks):
    out = tmp_path / "s"
    (marks / "fail-1").touch()
    code, _, err = cli("sweep", "test-marked", "--grid", "x=0,1", "--set", f"marks={marks}",
                       "--out", str(out), "--workers", "1")
    assert code == 1 and "--retry-errors" in err
    with open(out / RESULTS_FILE, "r+b") as fh:   # forget trial x=0: it is pending again
        lines = fh.read().splitlines(keepends=True)
        fh.seek(0)
        fh.truncate()
        fh.write(b"".join(line for line in lines if b'"x": 0' not in line))
    code, stdout, _ = cli("sweep", "--show", str(out))
    rows = {line.split()[2]: line.split()[1] for line in stdout.splitlines()[2:4]}
    assert code == 0 and rows == {"1": "error", "0": "pending"}
    assert "RuntimeError: trial x=1 was asked to fail" in stdout
    assert "0 ok, 1 failed, 1 pending" in stdout


def _not_a_sweep(tmp_path: Path) -> Path:
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    return out


def _other_sweep(tmp_path: Path) -> Path:
    out = tmp_path / "other"
    sweep.run("saturation", {"mechanism": ["scaled"], "d_k": [4]}, out, fixed=SAT_FIXED,
              workers=1)
    return out


SAT = ["sweep", "saturation", "--grid", "mechanism=scaled", "--grid", "d_k=4"]


@pytest.mark.parametrize("argv, message", [
    (["sweep", "saturatoin", "--out", "{tmp}/a"], "Did you mean: saturation?"),
    (["sweep", "saturation", "--grid", "dk=4", "--out", "{tmp}/a"], "Did you mean: d_k?"),
    (["sweep", "saturation", "--grid", "d_k=", "--out", "{tmp}/a"], "empty value"),
    (["sweep", "saturation", "--grid", "d_k=4,4", "--out", "{tmp}/a"], "more than once"),
    (["sweep", "saturation", "--grid", "d_k=four", "--out", "{tmp}/a"], "d_k must be an integer"),
    (["sweep", "saturation", "--grid", "d_k=4", "--grid", "mechanism=scald", "--out", "{tmp}/a"],
     "Did you mean: scaled?"),
    ([*SAT, "--set", "trials=1", "--out", "{tmp}/a"], "trials must be >= 2"),
    ([*SAT, "--set", "bogus=1", "--out", "{tmp}/a"], "Unknown setting 'bogus'"),
    ([*SAT, "--out", "{tmp}/file/a"], "cannot be created"),
    ([*SAT, "--out", "{tmp}/file"], "is a file"),
    ([*SAT, "--out", "{foreign}"], "holds files attnscale did not write"),
    ([*SAT, "--grid", "seed=1", "--out", "{other}"], "holds another sweep (grid seed"),
    ([*SAT, "--out", "{tmp}/a", "--workers", "0"], "workers must be >= 1"),
    ([*SAT, "--out", "{tmp}/a", "--ray", "--workers", "2"], "workers applies to the local"),
    ([*SAT, "--out", "{tmp}/a", "--gpus-per-trial", "1"], "--gpus-per-trial needs the Ray"),
    ([*SAT], "--out DIR is required"),
    (["sweep", "--resume", "{tmp}/nothing"], "holds no sweep"),
    (["sweep", "--resume", "{other}", "--grid", "d_k=4,8"], "pass --extend"),
    (["sweep", "--resume", "{other}", "--set", "n=3"], "--set cannot change"),
    (["sweep", "--show", "{foreign}"], "holds no sweep"),
    (["sweep"], "give one of EXPERIMENT"),
    (["sweep", "saturation", "--show", "{other}"], "not EXPERIMENT and --show"),
])
def test_cli_bad_input_is_one_line_and_exit_2(cli, tmp_path, argv, message):
    (tmp_path / "file").write_text("x")
    paths = {"tmp": tmp_path, "foreign": _not_a_sweep(tmp_path) if "{foreign}" in argv else "",
             "other": _other_sweep(tmp_path) if "{other}" in argv else ""}
    code, out, err = cli(*[a.format(**paths) for a in argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "a").exists()          # refused before any folder is made


def test_cli_ray_without_ray_installed_is_one_line(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what 'import ray' sees without Ray
    code, out, err = cli(*SAT, "--out", str(tmp_path / "a"), "--ray")
    assert code == 2 and err.count("\n") == 1
    assert "pip install 'attnscale[ray]'" in err and not (tmp_path / "a").exists()


# ---------------------------------------------------------------------------------------------
# study recall on the engine


def test_study_recall_resumes_and_redraws_from_the_store(cli, tmp_path):
    from attnscale.study.fragment import FRAGMENT_MD
    from attnscale.study.recall import SUMMARY
    out = tmp_path / "study"
    tiny = ("--mechanisms", "scaled,qknorm", "--d-k", "4", "--seed", "0,1", "--pairs", "4",
            "--steps", "4", "--batch-size", "4", "--json")
    code, stdout, err = cli("study", "recall", "--out", str(out), *tiny, "--workers", "2")
    assert code == 0, err
    rows = json.loads(stdout)["rows"]
    assert len(_lines(out)) == 4 and {r["seeds"] for r in rows} == {2}

    # Ctrl-C lost the run of qknorm, seed 1: --resume trains it alone
    kept = [line for line in (out / RESULTS_FILE).read_text().splitlines()
            if not ('"qknorm"' in line and '"seed": 1' in line)]
    (out / RESULTS_FILE).write_text("\n".join(kept) + "\n")
    code, stdout, err = cli("study", "recall", "--resume", str(out), "--json")
    assert code == 0 and json.loads(stdout)["rows"] == rows, err
    assert len(_lines(out)) == 4

    # --from trains nothing and draws the same table and files
    drawn = {name: (out / name).read_text() for name in
             (SUMMARY, FRAGMENT_MD)}
    before = (out / RESULTS_FILE).read_bytes()
    for name in drawn:
        (out / name).unlink()
    code, stdout, err = cli("study", "recall", "--from", str(out), "--json")
    assert code == 0 and json.loads(stdout)["rows"] == rows, err
    assert (out / RESULTS_FILE).read_bytes() == before
    assert {name: (out / name).read_text() for name in drawn} == drawn

    other = _other_sweep(tmp_path)
    code, _, err = cli("study", "recall", "--from", str(other))
    assert code == 2 and "holds a 'saturation' sweep, not a recall study" in err
    code, _, err = cli("study", "recall", "--from", str(out), "--out", str(out))
    assert code == 2 and "give one of --out DIR" in err


def test_the_readme_sweep_commands_parse_and_check(tmp_path):
    """Every ``attnscale sweep`` line of the README parses, and its grid passes every check a
    sweep makes before running (nothing is trained here)."""
    import shlex
    from attnscale.cli import build_parser
    from attnscale.sweep.engine import _check_trials
    text = (TESTS.parent / "README.md").read_text()
    section = text.split("## Sweeps:", 1)[1].split("\n## ", 1)[0]
    lines = [line.split("  #", 1)[0] for line in section.splitlines()
             if line.startswith("attnscale sweep ")]
    assert len(lines) >= 5
    for line in lines:
        args = build_parser().parse_args(shlex.split(line)[1:])
        if args.experiment is not None:
            exp = registry.get(args.experiment)
            spec = SweepSpec.build(exp, parse_grid(exp, args.grid), parse_fixed(exp, args.set))
            _check_trials(exp, spec.trials())
            assert spec.trials()
