"""``attnscale study NAME --resume DIR --extend``: a study folder grows to the study's spec as it is
now (values and stores the spec has gained, e.g. newly registered mechanisms) by running only the
new trials; what the folder holds keeps its records."""

from __future__ import annotations

import json

import pytest

from attnscale import sweep
from attnscale.study import STUDIES, Analysis, Study, Trials, launcher, register
from attnscale.study.registry import get

# The tiny study's mechanism axis, read when it runs: a test adds to it, as registering a
# mechanism adds to the recall study's.
MECHANISMS = ["scaled"]


def _analyse(stores):
    rows = [{"store": key, "mechanism": r["config"]["mechanism"], "seed": r["config"]["seed"]}
            for key, records in stores.items() for r in records]
    return Analysis("runs: " + ", ".join(f"{r['store']}/{r['mechanism']}/{r['seed']}"
                                         for r in rows) + "\n", [], {"rows": rows}, {},
                    table=rows, columns=["store", "mechanism", "seed"])


SMALL = Trials("saturation", {"mechanism": lambda: list(MECHANISMS), "seed": (0,)},
               {"d_k": 4, "n": 16, "trials": 10})
GROWN = Study(
    name="grown-test", title="grows", doc="A study whose grid and stores grow.",
    stores={"a": SMALL}, quick={"a": SMALL}, analyse=_analyse, summary="grown.json",
    figures=())


@pytest.fixture
def grown():
    MECHANISMS[:] = ["scaled"]
    register(GROWN)
    try:
        yield GROWN
    finally:
        del STUDIES[GROWN.name]


def _records(path):
    return [line for line in (path / "results.jsonl").read_text().splitlines() if line]


def test_extend_runs_only_the_new_trials_and_keeps_the_old_records(cli, grown, tmp_path):
    out = tmp_path / "grown"
    code, _, err = cli("study", "grown-test", "--out", str(out), "--workers", "1")
    assert code == 0, err
    before = _records(out)
    assert len(before) == 1
    MECHANISMS.append("softpick")                      # the spec gains a mechanism
    # A plain resume runs the stored settings: nothing new.
    code, stdout, err = cli("study", "grown-test", "--resume", str(out), "--json")
    assert code == 0 and json.loads(stdout)["runs"]["a"]["ok"] == 1, err
    # --extend grows the store: the new trial only, the old record untouched and first.
    code, stdout, err = cli("study", "grown-test", "--resume", str(out), "--extend", "--json")
    assert code == 0, err
    assert json.loads(stdout)["runs"]["a"] == {"ok": 2, "failed": 0, "pending": 0}
    after = _records(out)
    assert after[:1] == before and len(after) == 2
    assert sweep.load(out).spec.grid["mechanism"] == ["scaled", "softpick"]
    # Nothing more to add: a second --extend runs nothing and changes no record.
    code, _, err = cli("study", "grown-test", "--resume", str(out), "--extend")
    assert code == 0 and _records(out) == after, err


def test_extend_starts_a_store_the_study_has_gained(cli, tmp_path):
    MECHANISMS[:] = ["scaled"]
    two = Study(**{**GROWN.__dict__, "name": "grown2-test",
                   "stores": {"a": SMALL, "b": SMALL}, "quick": None})
    register(two)
    try:
        out = tmp_path / "two"
        code, _, err = cli("study", "grown2-test", "--out", str(out), "--workers", "1")
        assert code == 0 and (out / "b" / "results.jsonl").is_file(), err
        # As if store b had come with a later version: its files and its study.json entry go.
        for f in ("results.jsonl", "sweep.json"):
            (out / "b" / f).unlink()
        settings = json.loads((out / launcher.STUDY_FILE).read_text())
        del settings["stores"]["b"]
        (out / launcher.STUDY_FILE).write_text(json.dumps(settings))
        code, stdout, err = cli("study", "grown2-test", "--resume", str(out), "--json")
        assert code == 0 and "b" not in json.loads(stdout)["runs"], err
        code, stdout, err = cli("study", "grown2-test", "--resume", str(out), "--extend",
                                "--json")
        assert code == 0, err
        assert json.loads(stdout)["runs"] == {k: {"ok": 1, "failed": 0, "pending": 0}
                                              for k in ("a", "b")}
    finally:
        del STUDIES["grown2-test"]


def test_a_resume_refuses_a_drawn_file_someone_changed_before_any_trial(cli, grown, tmp_path):
    out = tmp_path / "grown"
    code, _, err = cli("study", "grown-test", "--out", str(out), "--workers", "1")
    assert code == 0, err
    (out / "grown.json").write_text("{}")               # edited by hand since it was drawn
    MECHANISMS.append("softpick")
    code, _, err = cli("study", "grown-test", "--resume", str(out), "--extend")
    assert code == 2 and "grown.json" in err and "--force" in err
    assert len(_records(out)) == 1                      # refused up front: nothing ran
    code, _, err = cli("study", "grown-test", "--resume", str(out), "--extend", "--force")
    assert code == 0, err
    assert len(_records(out)) == 2 and json.loads((out / "grown.json").read_text())


def test_extend_needs_resume(cli, grown, tmp_path):
    code, _, err = cli("study", "grown-test", "--out", str(tmp_path / "x"), "--extend")
    assert code == 2 and "--extend" in err and err.count("\n") == 1


@pytest.mark.parametrize("name", ["recall", "lm", "length"])
def test_the_shipped_stores_hold_their_study_or_grow_by_mechanisms_alone(name):
    """What ``--resume --extend`` would add to each published study (planned, not run): nothing
    for a study grown to every registered mechanism, else only mechanisms (and the LM's sinks
    store, which its normalisers' runs fill); no value the stores hold is dropped or changed."""
    from pathlib import Path

    from attnscale.sweep.store import Store
    root = Path(__file__).resolve().parents[1] / "docs" / "results" / name
    study = get(name)
    plan = launcher.settings(study)
    added = {}
    for key, path in launcher.store_paths(study, root).items():
        if not Store(path).exists():
            added[key] = "new store"
            continue
        spec = Store(path).read_spec()
        grid = launcher.grown_grid(spec, plan[key])
        if grid is not None:
            assert all(grid[axis][:len(values)] == values for axis, values in spec.grid.items())
            added[key] = {axis: grid[axis][len(spec.grid[axis]):] for axis in grid
                          if len(grid[axis]) > len(spec.grid[axis])}
    if name == "lm":  # still growing: what is left is the newest mechanisms and the sinks store
        assert set(added) <= {"lm", "sinks"} and added.get("sinks", "new store") == "new store"
        assert set(added.get("lm", {})) <= {"variant"}
        assert set(added.get("lm", {}).get("variant", [])) <= {"forgetting", "selective",
                                                               "differential"}
    else:
        assert added == {}


def test_the_results_page_figures_are_figures_of_the_study():
    from dataclasses import replace

    from attnscale.study import get

    # the page shows what each shipped spec names, in the order of its folders
    assert list(get("lm").page_figures) == ["lm_lr_sensitivity.png", "lm_loss_vs_lr.png"]
    odd = replace(GROWN, name="odd-test", figures=("a.png",), page_figures={"b.png": "B"})
    with pytest.raises(ValueError, match="page_figures names b.png"):
        register(odd)
    assert "odd-test" not in STUDIES
