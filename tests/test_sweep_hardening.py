"""The sweep store against the hardening classes, each over every experiment or command it
applies to: a store pins the files its trials read; one value is one trial; one writer per store;
Ctrl-C stops a batched sweep; a complete last record is kept; every error says what to do, and
that advice works; damaged or unwritable stores are one-line errors; the token cache is never
data; an experiment defined in a script says how to resume it.

The class-wide tests walk the experiment registry and the parameters' types, so a new experiment
(or a new path, int, float or dict parameter) is covered without editing this file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sweep_batch_experiments
from children import sigint_default
from sweep_experiments import wait_until
from attnscale import sweep
from attnscale.errors import ConfigError
from attnscale.experiments import registry
from attnscale.experiments.lm import data as lm_data
from attnscale.io import LOCK
from attnscale.mechanisms import MECHANISMS, canonical_options, option_types
from attnscale.sweep import engine
from attnscale.sweep.grid import SweepSpec, check_grid, check_pins, differences, parse_fixed, \
    parse_grid
from attnscale.sweep.store import RESULTS_FILE, SPEC_FILE

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
SAT = ["sweep", "saturation", "--grid", "mechanism=scaled", "--grid", "d_k=4,8",
       "--set", "n=16", "--set", "trials=20"]
# Tiny settings of the lm experiment (a run takes well under a second).
LM_TINY = ["--set", "d_model=16", "--set", "seq_len=16", "--set", "batch_size=4",
           "--set", "steps=2", "--set", "eval_windows=2", "--set", "monitor_every=1"]


def _one_line(code: int, err: str, *needles: str) -> None:
    """Exit 2 with one line on stderr holding every needle, and no traceback."""
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def _sat_store(cli, out: Path) -> Path:
    code, _, err = cli(*SAT, "--out", str(out), "--workers", "1")
    assert code == 0, err
    return out


def _lines(out: Path) -> list[str]:
    return (out / RESULTS_FILE).read_text().splitlines()


def _required(exp: registry.Experiment, folder: Path | None = None,
              but: str | None = None) -> dict[str, list]:
    """A one-value grid for the parameters without a default (a valid value of each type), but
    ``but``; with ``folder``, a required path is a file written there (the store pins it)."""
    sample = {str: "scaled", int: 4, float: 1.0, bool: True, dict: {}}
    out = {}
    for k, p in exp.params.items():
        if not p.required or k == but:
            continue
        out[k] = [sample[p.type]]
        if folder is not None and k in exp.paths():
            (folder / f"required-{k}").write_text("a file the store pins\n")
            out[k] = [str(folder / f"required-{k}")]
    return out


EXPERIMENTS = sorted(registry.EXPERIMENTS)
PATHS = [(name, key) for name in EXPERIMENTS for key in registry.get(name).paths()]


# ---------------------------------------------------------------------------------------------
# A store pins everything a trial depends on


def test_the_corpus_experiments_declare_their_data_path():
    assert ("lm", "data") in PATHS and ("lm-length", "data") in PATHS
    for name, key in PATHS:
        assert registry.get(name).params[key].fingerprint is not None


def test_a_path_parameter_must_be_a_string():
    with pytest.raises(ValueError, match="is a path"):
        registry.experiment("test-bad-path", params={"data": registry.Param(
            int, 0, path=True)})(lambda **config: {})
    assert "test-bad-path" not in registry.EXPERIMENTS


@pytest.mark.parametrize("name, key", PATHS)
def test_a_path_is_stored_absolute_and_pinned(tmp_path, monkeypatch, name, key):
    exp = registry.get(name)
    work = tmp_path / "work"
    (work / "dd").mkdir(parents=True)
    corpus = work / "dd" / "f1.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    monkeypatch.chdir(work)
    absolute = str(corpus.resolve())
    assert parse_fixed(exp, [f"{key}=dd/f1.txt"])[key] == absolute
    assert check_grid(exp, {key: ["dd/f1.txt"]})[key] == [absolute]
    spec = SweepSpec.build(exp, _required(exp, tmp_path, but=key), {key: "dd/f1.txt"})
    assert spec.base[key] == absolute
    assert spec.pinned[key][absolute]["bytes"] == corpus.stat().st_size
    monkeypatch.chdir(tmp_path)                       # a resume from elsewhere: the same file
    check_pins(exp, SweepSpec.from_json(json.loads(json.dumps(spec.to_json()))), "S")
    corpus.write_text("the quick brown fox jumps over the lazy cat\n" * 40)  # same size
    with pytest.raises(ConfigError, match=f"{key} .* changed since the sweep in 'S'"):
        check_pins(exp, spec, "S")
    corpus.unlink()
    with pytest.raises(ConfigError, match="cannot be read now"):
        check_pins(exp, spec, "S")
    with pytest.raises(ConfigError, match=f"{key} must be a path"):
        parse_fixed(exp, [f"{key}="])


def test_lm_resumed_from_another_directory_reads_the_pinned_corpus(cli, tmp_path, monkeypatch):
    """The sweep is made in work/ with a relative --set data; a trial lost from the store is
    re-run from elsewhere/, which holds another dd/f1.txt: it trains on the first one, to the
    same bytes; once that file changes, the resume is refused."""
    for folder, word in (("work", "alpha"), ("elsewhere", "omega")):
        (tmp_path / folder / "dd").mkdir(parents=True)
        (tmp_path / folder / "dd" / "f1.txt").write_text(f"{word} beta gamma delta\n" * 300)
    monkeypatch.chdir(tmp_path / "work")
    code, _, err = cli("sweep", "lm", "--grid", "seed=0,1", "--set", "data=dd/f1.txt", *LM_TINY,
                       "--out", "S", "--workers", "1")
    assert code == 0, err
    store = tmp_path / "work" / "S"
    first = {json.loads(line)["trial"]: json.loads(line)["result"] for line in _lines(store)}
    (store / RESULTS_FILE).write_text(_lines(store)[0] + "\n")     # seed 1's record lost
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, _, err = cli("sweep", "--resume", "../work/S", "--workers", "1")
    assert code == 0, err
    again = {json.loads(line)["trial"]: json.loads(line)["result"] for line in _lines(store)}
    assert again == first
    (tmp_path / "work" / "dd" / "f1.txt").write_text("changed\n" * 300)
    code, _, err = cli("sweep", "--resume", "../work/S", "--workers", "1")
    _one_line(code, err, "data", "changed since the sweep", "new folder")


def test_the_cache_inside_a_data_folder_is_not_data(tmp_path, monkeypatch):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(3):
        (folder / f"f{i}.txt").write_text(f"text number {i}\n" * 200)
    monkeypatch.setenv("ATTNSCALE_CACHE", str(folder / "cache"))
    before = lm_data.fingerprint(folder)
    corpora = [lm_data.load_corpus(folder) for _ in range(3)]
    assert (folder / "cache").is_dir()                     # the cache was written inside
    assert [c.files for c in corpora] == [3, 3, 3]
    assert len({c.bytes for c in corpora}) == 1
    lm_data._FINGERPRINTS.clear()
    assert lm_data.fingerprint(folder) == before


# ---------------------------------------------------------------------------------------------
# One value, one trial


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_one_parsing_rule_and_repeats_by_value_for_every_parameter(name):
    """An integral float is an int (CLI text as JSON); a repeat after canonicalisation is a
    ConfigError naming the key, from --grid text, a --grid JSON list and the API; a JSON object
    that gives a key twice is refused."""
    exp = registry.get(name)
    twins = {int: ("3,3.0,3e0", [3, 3.0]), float: ("20,20.0,2e1", [20, 2e1]),
             dict: (None, [{"a": 20}, {"a": 2e1}])}
    checked = set()
    for key, p in exp.params.items():
        if p.type not in twins or key in exp.paths():
            continue
        text, values = twins[p.type]
        if p.type is int:
            assert parse_fixed(exp, [f"{key}=1e3"]) == {key: 1000}
            assert type(parse_fixed(exp, [f"{key}=4.0"])[key]) is int
            with pytest.raises(ConfigError, match=f"{key} must be an integer"):
                parse_fixed(exp, [f"{key}=2.5"])
        if text is not None:
            with pytest.raises(ConfigError, match=f"grid {key} lists .* more than once"):
                parse_grid(exp, [f"{key}={text}"])
        with pytest.raises(ConfigError, match=f"grid {key} lists .* more than once"):
            parse_grid(exp, [f"{key}={json.dumps(values)}"])
        with pytest.raises(ConfigError, match=f"grid {key} lists .* more than once"):
            SweepSpec.build(exp, {**_required(exp), key: values})
        if p.type is dict:
            with pytest.raises(ConfigError, match=f"{key}: key 'a' is given twice"):
                parse_fixed(exp, [f'{key}={{"a": 20, "a": 30}}'])
            with pytest.raises(ConfigError, match=f"--grid {key}: key 'a' is given twice"):
                parse_grid(exp, [f'{key}=[{{"a": 20, "a": 30}}]'])
        checked.add(p.type)
    assert checked & {int, float}, f"{name} has no number parameter to check"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_a_default_written_out_is_the_same_sweep(name, tmp_path):
    exp = registry.get(name)
    grid = _required(exp, tmp_path)
    defaults = {k: p.default for k, p in exp.params.items() if not p.required}
    implicit, explicit = SweepSpec.build(exp, grid), SweepSpec.build(exp, grid, defaults)
    assert differences(implicit, explicit, exp) == []
    assert [t.id for t in implicit.trials()] == [t.id for t in explicit.trials()]


def test_a_default_written_out_continues_the_stored_sweep(cli, tmp_path):
    out = _sat_store(cli, tmp_path / "s")
    before = _lines(out)
    code, _, err = cli(*SAT, "--set", "seed=0", "--out", str(out), "--workers", "1")
    assert code == 0, err
    assert _lines(out) == before                          # nothing re-run


@pytest.mark.parametrize("name", sorted(n for n in MECHANISMS if option_types(n)))
def test_mechanism_options_are_typed_by_the_mechanism(name):
    for option, kind in option_types(name).items():
        if kind is float:
            assert canonical_options(name, {option: 20}) == {option: 20.0}
            assert type(canonical_options(name, {option: 20})[option]) is float
        elif kind is int:
            assert canonical_options(name, {option: 20.0}) == {option: 20}
            assert type(canonical_options(name, {option: 20.0})[option]) is int
        else:  # a string or a bool is left as it is
            assert canonical_options(name, {option: True}) == {option: True}


@pytest.mark.parametrize("variants", [["scaled", "scaled()"],
                                      ["softcap(cap=20)", "softcap(cap=20.0)", "softcap(cap=2e1)"],
                                      ["qknorm(max_len=64)", "qknorm(max_len=64.0)"],
                                      ["qk-layernorm(divisor=false)", "qk-layernorm(divisor=False)"]],
                         ids=lambda v: ",".join(v))
def test_variants_with_one_meaning_are_one_trial(variants):
    from attnscale.experiments.lm.study import parse_variant
    lm = registry.get("lm")
    with pytest.raises(ConfigError, match="grid variant lists .* more than once"):
        SweepSpec.build(lm, {"variant": variants})
    assert len({json.dumps(parse_variant(v)) for v in variants}) == 1   # the study's parser too


def test_recall_options_with_one_meaning_are_one_trial():
    recall = registry.get("recall")
    with pytest.raises(ConfigError, match="grid options lists .* more than once"):
        parse_grid(recall, ['options=[{"cap": 20}, {"cap": 2e1}]'])
    a = SweepSpec.build(recall, {"options": [{"cap": 20}]}, {"mechanism": "softcap"})
    b = SweepSpec.build(recall, {"options": [{"cap": 2e1}]}, {"mechanism": "softcap"})
    assert a.grid == {"options": [{"cap": 20.0}]}
    assert [t.id for t in a.trials()] == [t.id for t in b.trials()]


# ---------------------------------------------------------------------------------------------
# One writer per store; a run that ends with trials pending is a failure


def _driver(*argv: str, **popen) -> subprocess.Popen:
    """``attnscale sweep ...`` in a child with the test experiments registered, SIGINT at its
    default (as in a shell), in a process group of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    code = ("import sys, sweep_experiments, sweep_batch_experiments; "
            "from attnscale.cli import main; sys.exit(main())")
    return subprocess.Popen([sys.executable, "-c", code, "sweep", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: (sigint_default(), os.setpgrp()), **popen)


def test_a_second_writer_is_refused_naming_the_pid(cli, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "s"
    driver = _driver("test-marked", "--grid", "x=0,1", "--set", f"marks={marks}",
                     "--set", "gate=true", "--out", str(out), "--workers", "1")
    try:
        wait_until(lambda: (marks / "held-0").exists() or driver.poll() is not None,
                   "the first trial started")
        assert driver.poll() is None, driver.communicate()
        with pytest.raises(ConfigError, match=f"being written by another .*pid {driver.pid}"):
            sweep.resume(out, workers=1)
        with pytest.raises(ConfigError, match=f"pid {driver.pid}"):
            sweep.run("test-marked", {"x": [0, 1, 2]}, out, fixed={"marks": str(marks),
                                                                  "gate": True}, extend=True)
        code, _, err = cli("sweep", "--resume", str(out), "--extend", "--grid", "x=0,1,2")
        _one_line(code, err, f"pid {driver.pid}", "wait for it to finish")
    finally:
        (marks / "go-all").touch()
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 0, err
    assert len(_lines(out)) == 2                          # nothing lost, nothing twice


def test_a_lock_left_by_a_dead_process_is_taken_over(cli, tmp_path):
    out = _sat_store(cli, tmp_path / "s")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK).write_text(f"{dead.pid}\n")
    (out / RESULTS_FILE).write_text(_lines(out)[0] + "\n")
    code, _, err = cli("sweep", "--resume", str(out), "--workers", "1")
    assert code == 0, err
    assert len(_lines(out)) == 2 and (out / LOCK).read_text().strip() != str(dead.pid)


def test_a_run_that_ends_with_trials_pending_exits_non_zero(cli, tmp_path, monkeypatch):
    real = engine.run_local
    monkeypatch.setattr(engine, "run_local",
                        lambda tasks, record, **kw: real(tasks[:-1], record, **kw))
    code, _, err = cli(*SAT, "--out", str(tmp_path / "s"), "--workers", "1")
    assert code == 1 and "1 trial is still pending" in err and "--resume" in err


# ---------------------------------------------------------------------------------------------
# Ctrl-C stops a batched sweep (while its workers start, or mid-chunk), and the chunk re-runs


@pytest.mark.parametrize("when, how, to_group", [
    ("start", signal.SIGINT, True),       # during the workers' start-up (the fork server's imports)
    ("chunk", signal.SIGINT, False),      # mid-chunk, to the driver alone
    ("chunk", signal.SIGTERM, True),      # mid-chunk, to the whole group
])
def test_a_batched_sweep_stops_at_once_and_resumes(tmp_path, when, how, to_group):
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "s"
    driver = _driver("test-batched-held", "--grid", "x=0,1,2,3", "--set", f"marks={marks}",
                     "--out", str(out), "--workers", "2")
    ready = (lambda: (out / SPEC_FILE).exists()) if when == "start" else \
        (lambda: any(marks.glob("held-*")))
    wait_until(lambda: ready() or driver.poll() is not None, f"the sweep at {when}")
    assert driver.poll() is None, driver.communicate()
    sent = time.monotonic()
    (os.killpg if to_group else os.kill)(driver.pid, how)
    _, err = driver.communicate(timeout=60)
    took = time.monotonic() - sent
    assert driver.returncode == 128 + how and "Traceback" not in err, err
    assert "leaked" not in err, err
    # The held chunks never end before "go" below, so an exit at all means the driver did not
    # wait for them; the bound only leaves room for a fork server still importing torch on a
    # loaded machine (10.2 s measured at load 7).
    assert took < 30, f"exit took {took:.1f} s"
    assert not (out / RESULTS_FILE).exists() or _lines(out) == []   # the chunk was in flight
    (marks / "go").touch()
    done = sweep.resume(out, workers=2, show_progress=False)
    assert done.complete and len(done) == 4
    assert sorted(x for call in sweep_batch_experiments.calls(marks) for x in call) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# A complete last record is kept


def test_a_last_record_without_its_newline_is_kept(cli, tmp_path):
    out = _sat_store(cli, tmp_path / "s")
    text = (out / RESULTS_FILE).read_text()
    (out / RESULTS_FILE).write_text(text.rstrip("\n"))
    loaded = sweep.load(out)
    assert len(loaded) == 2 and not loaded.pending
    code, stdout, _ = cli("sweep", "--show", str(out), "--json")
    assert code == 0 and json.loads(stdout)["pending"] == 0
    code, _, err = cli("sweep", "--resume", str(out), "--workers", "1")
    assert code == 0, err
    assert (out / RESULTS_FILE).read_text() == text       # kept, and its newline repaired


def test_a_trailing_blank_line_does_not_block_resume(cli, tmp_path):
    out = _sat_store(cli, tmp_path / "s")
    lines = _lines(out)
    (out / RESULTS_FILE).write_text(lines[0] + "\n\n")
    code, _, err = cli("sweep", "--resume", str(out), "--workers", "1")
    assert code == 0, err
    results = [json.loads(line) for line in _lines(out) if line]
    assert {r["trial"]: r["result"] for r in results} == \
        {r["trial"]: r["result"] for r in map(json.loads, lines)}


# ---------------------------------------------------------------------------------------------
# No dead ends: each error says what to do, and that advice works


def test_an_edited_sweep_json_resumes_with_force(cli, tmp_path):
    out = _sat_store(cli, tmp_path / "s")
    spec = (out / SPEC_FILE).read_text()
    (out / SPEC_FILE).write_text(spec.replace('"trials": 20', '"trials": 21'))
    code, _, err = cli("sweep", "--resume", str(out), "--workers", "1")
    _one_line(code, err, SPEC_FILE, "was changed", "--force")
    code, _, err = cli("sweep", "--resume", str(out), "--force", "--workers", "1")
    assert code == 0, err
    assert all(json.loads(line)["config"]["trials"] == 21 for line in _lines(out)[2:])
    code, _, err = cli("sweep", "--resume", str(out), "--workers", "1")   # attnscale's again
    assert code == 0, err


def test_every_one_byte_change_of_sweep_json_gives_advice_that_works(cli, tmp_path):
    """A byte changed anywhere in sweep.json: --resume either works or is one line of advice;
    following it (--force where it says so) either works or ends in advice that does not send
    the user back to --force."""
    store = _sat_store(cli, tmp_path / "s")
    data = (store / SPEC_FILE).read_bytes()
    positions = range(0, len(data), max(1, len(data) // 25))
    for i in positions:
        out = tmp_path / f"edit-{i}"
        shutil.copytree(store, out)
        edited = bytearray(data)
        edited[i] = ord("7") if edited[i] != ord("7") else ord("8")
        (out / SPEC_FILE).write_bytes(bytes(edited))
        code, _, err = cli("sweep", "--resume", str(out), "--workers", "1")
        if code == 0:
            continue
        _one_line(code, err)
        assert "--force" in err or "restore" in err.lower(), err
        if "--force" in err:
            code, _, err = cli("sweep", "--resume", str(out), "--force", "--workers", "1")
            assert code == 0 or (err.count("\n") == 1 and "--force" not in err), (i, err)


@pytest.mark.parametrize("address", ["foo", "127.0.0.1:1", "ray://127.0.0.1:1"])
def test_a_failed_ray_start_leaves_nothing_and_the_corrected_command_works(cli, tmp_path,
                                                                            monkeypatch, address):
    import ray  # noqa: F401  (the test extra has it: a missing one fails, never skips)

    from attnscale.sweep import ray_exec
    monkeypatch.setattr(ray_exec, "CONNECT_TIMEOUT", 2.0)
    out = tmp_path / "s"
    start = time.monotonic()
    code, _, err = cli(*SAT, "--out", str(out), "--ray", address)
    _one_line(code, err, "--ray", address)
    assert time.monotonic() - start < 30
    assert not out.exists()
    code, _, err = cli(*SAT, "--out", str(out), "--workers", "1")
    assert code == 0, err


# ---------------------------------------------------------------------------------------------
# Hand-edited or damaged stores: one line naming the file, the line and the field


def _edit_record(record: dict, field: str, value) -> dict:
    if value is _DROP:
        return {k: v for k, v in record.items() if k != field}
    return {**record, field: value}


_DROP = object()
RECORD_EDITS = [("config", None), ("config", _DROP), ("wall_seconds", _DROP), ("trial", ["x"]),
                ("error", 5), ("status", "done"), ("wall_seconds", "fast"), ("host", 3)]


@pytest.mark.parametrize("field, value", RECORD_EDITS,
                         ids=[f"{f}={'missing' if v is _DROP else json.dumps(v)}"
                              for f, v in RECORD_EDITS])
def test_a_damaged_record_is_one_line_naming_file_line_and_field(cli, tmp_path, field, value):
    out = _sat_store(cli, tmp_path / "s")
    lines = _lines(out)
    lines[1] = json.dumps(_edit_record(json.loads(lines[1]), field, value))
    (out / RESULTS_FILE).write_text("\n".join(lines) + "\n")
    for argv in (["--show", str(out)], ["--resume", str(out), "--workers", "1"],
                 ["--resume", str(out), "--extend", "--grid", "d_k=4,8,16"]):
        code, _, err = cli("sweep", *argv)
        _one_line(code, err, RESULTS_FILE, "line 2", repr(field))


# A recorded metric edited to something that is not a finite number: NaN and Infinity are not
# JSON attnscale writes (a trial's result is strict JSON), and null where the trial wrote a number
# contradicts the record's own list of nulls.
METRIC_EDITS = ["NaN", "Infinity", "-Infinity", "null"]


@pytest.mark.parametrize("token", METRIC_EDITS)
def test_a_metric_edited_to_a_non_number_is_one_line_naming_file_line_and_field(cli, tmp_path,
                                                                                token):
    out = _sat_store(cli, tmp_path / "s")
    lines = _lines(out)
    assert json.loads(lines[1])["nulls"] == []
    lines[1] = lines[1].replace('"entropy_mean": ', f'"entropy_mean": {token}, "was": ', 1)
    (out / RESULTS_FILE).write_text("\n".join(lines) + "\n")
    for argv in (["--show", str(out)], ["--resume", str(out), "--workers", "1"]):
        code, _, err = cli("sweep", *argv)
        _one_line(code, err, RESULTS_FILE, "line 2", "'result.entropy_mean'", "finite number")
    with pytest.raises(ConfigError, match=r"line 2 .*'result\.entropy_mean'"):
        sweep.load(out)


def test_nulls_the_trial_wrote_are_kept_and_checked(tmp_path):
    from attnscale.sweep.store import Store, record_line, result_nulls
    result = {"loss": [2.0, 1.5, None, None, None], "final": None, "steps": 3,
              "trace": [{"h": 0.5}, {"h": None}]}
    assert result_nulls(result) == ["result.loss[2:5]", "result.final", "result.trace[1].h"]
    record = {"trial": "t1", "config": {}, "status": "ok", "result": result,
              "wall_seconds": 1.0}
    store = Store(tmp_path)
    store.results_path.write_text(record_line(record))
    assert store.records()[0]["result"] == result           # a diverged run's nulls are data
    for path, edit in (("result.loss[1]", lambda r: r["loss"].__setitem__(1, None)),
                       ("result.steps", lambda r: r.__setitem__("steps", None)),
                       ("result.trace[0].h", lambda r: r["trace"][0].__setitem__("h", None))):
        changed = json.loads(json.dumps(result))
        edit(changed)
        line = json.loads(record_line(record))
        store.results_path.write_text(json.dumps({**line, "result": changed}) + "\n")
        with pytest.raises(ConfigError, match=rf"line 1 .*'{re.escape(path)}'.*got null"):
            store.records()
    # a record from before nulls were listed: its nulls cannot be told apart, its NaN can
    legacy = {k: v for k, v in json.loads(record_line(record)).items() if k != "nulls"}
    store.results_path.write_text(json.dumps(legacy) + "\n")
    assert store.records()[0]["result"] == result
    store.results_path.write_text(json.dumps({**legacy, "result": {"x": float("nan")}}) + "\n")
    with pytest.raises(ConfigError, match="'result.x' must be a finite number, got NaN"):
        store.records()


@pytest.mark.parametrize("edit, field", [
    (lambda s: {**s, "grid": {"d_k": 5}}, "grid"),
    (lambda s: {**s, "grid": {"d_k": ["x"]}}, "grid"),
    (lambda s: {**s, "grid": {"bogus": [1]}}, "grid"),
    (lambda s: {**s, "base": None}, "base"),
    (lambda s: {**s, "experiment": 5}, "experiment"),
    (lambda s: [], "not an attnscale sweep"),
    (lambda s: '{"format": "attnscale-sweep", "format": 1}', "given twice"),
], ids=["grid-not-list", "grid-bad-value", "grid-unknown-key", "base-null", "experiment-number",
        "a-list", "duplicate-key"])
def test_a_damaged_sweep_json_is_one_line_naming_the_field(cli, tmp_path, edit, field):
    out = _sat_store(cli, tmp_path / "s")
    obj = edit(json.loads((out / SPEC_FILE).read_text()))
    (out / SPEC_FILE).write_text(obj if isinstance(obj, str) else json.dumps(obj))
    for extra in ([], ["--force"]):
        code, _, err = cli("sweep", "--resume", str(out), *extra, "--workers", "1")
        _one_line(code, err, SPEC_FILE)
        assert field in err or "--force" in err, err
    code, _, err = cli("sweep", "--resume", str(out), "--force", "--workers", "1")
    assert field in err, err
    code, _, err = cli("sweep", "--show", str(out))
    assert code in (0, 2) and "Traceback" not in err


def test_an_unwritable_results_file_is_refused_before_any_trial(cli, tmp_path):
    out = _sat_store(cli, tmp_path / "s")
    before = (out / RESULTS_FILE).read_bytes()
    (out / RESULTS_FILE).unlink()
    (out / RESULTS_FILE).mkdir()                   # cannot be appended to, even by root
    code, _, err = cli("sweep", "--resume", str(out), "--extend", "--grid", "d_k=4,8,16")
    _one_line(code, err, RESULTS_FILE)
    assert "leaked" not in err
    (out / RESULTS_FILE).rmdir()
    (out / RESULTS_FILE).write_bytes(before)
    # immutable (chattr +i, which stops root too, where the file system allows it), and
    # read-only (which stops every user but root)
    path = str(out / RESULTS_FILE)
    for lock, unlock in ((["chattr", "+i", path], ["chattr", "-i", path]),
                         (["chmod", "444", path], ["chmod", "644", path])):
        if subprocess.run(lock, capture_output=True).returncode != 0:
            continue
        try:
            if os.access(path, os.W_OK) and os.geteuid() == 0 and lock[0] == "chmod":
                continue                           # root writes a read-only file anyway
            code, _, err = cli("sweep", "--resume", str(out), "--extend", "--grid", "d_k=4,8,16")
            _one_line(code, err, RESULTS_FILE, "not writable", "chmod u+w")
            assert "leaked" not in err
        finally:
            subprocess.run(unlock, capture_output=True)
    assert (out / RESULTS_FILE).read_bytes() == before  # nothing ran


# ---------------------------------------------------------------------------------------------
# An experiment defined in a script


SCRIPT = '''
import sys
from attnscale import sweep

@sweep.experiment("test-script-defined")
def trial(*, x: int) -> dict:
    return {"x": x}

if sys.argv[1] == "run":
    sweep.run("test-script-defined", {"x": [0, 1]}, sys.argv[2], workers=1, show_progress=False)
else:
    print(len(sweep.resume(sys.argv[2], workers=1, show_progress=False)))
'''


def test_a_sweep_of_a_script_experiment_says_how_to_resume_it(cli, tmp_path):
    script = tmp_path / "my_sweep.py"
    script.write_text(SCRIPT)
    out = tmp_path / "s"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    subprocess.run([sys.executable, str(script), "run", str(out)], env=env, check=True,
                   timeout=300)
    (out / RESULTS_FILE).write_text(_lines(out)[0] + "\n")
    code, _, err = cli("sweep", "--resume", str(out))
    _one_line(code, err, "test-script-defined", str(script.resolve()), "sweep.resume")
    done = subprocess.run([sys.executable, str(script), "resume", str(out)], env=env, check=True,
                          timeout=300, capture_output=True, text=True)
    assert done.stdout.strip() == "2"


def test_a_driver_read_from_stdin_is_refused_before_any_work(tmp_path):
    """Local workers re-import the driver's __main__ from its file; from stdin there is none."""
    import subprocess
    import sys
    out = tmp_path / "s"
    script = (f"from attnscale import sweep\n"
              f"sweep.run('saturation', {{'seed': [0], 'mechanism': ['scaled']}}, {str(out)!r}, "
              f"fixed={{'d_k': 16}}, workers=1)\n")
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "read from '<stdin>', not a file" in done.stderr
    assert not out.exists()
