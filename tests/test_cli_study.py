"""The one study launcher: a study registered from this file runs, resumes and redraws through
``attnscale study``, and the rules every study keeps are checked over every registered study."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from attnscale import sweep
from attnscale.errors import ConfigError
from attnscale.io import folder_marks, mark_folder
from attnscale.report.include import load_study
from attnscale.study import STUDIES, Analysis, Option, Study, Trials, launcher, register
from attnscale.study import claims as claim_rules
from attnscale.study.registry import get
from attnscale.study.seeds import spread

# --- a study in a few lines ---------------------------------------------------------------------


def _analyse(stores):
    """Max attention weight per mechanism over seeds, and one claim over the seed ranges."""
    by = {}
    for r in stores["saturation"]:
        by.setdefault(r["config"]["mechanism"], []).append(r["result"]["max_weight_mean"])
    rows = [{"mechanism": m, **spread(v)} for m, v in by.items()]
    cell = {r["mechanism"]: r for r in rows}
    claims = []
    if {"scaled", "unscaled"} <= set(cell):
        verdict, agrees = claim_rules.verdict(
            [claim_rules.compare(cell["unscaled"], cell["scaled"])], "higher")
        claims.append(claim_rules.claim("max weight, unscaled vs scaled", "higher than scaled",
                                        cell["unscaled"]["mean"],
                                        claim_rules.interval(cell["unscaled"]), verdict, agrees))

    def figure():
        from attnscale.plotting import new_figure
        fig, (ax,) = new_figure()
        ax.bar([r["mechanism"] for r in rows], [r["mean"] for r in rows])
        return fig

    md = "| mechanism | max weight |\n|---|---|\n" + "".join(
        f"| {r['mechanism']} | {claim_rules.range_text(r)} |\n" for r in rows) + \
        "\n![max weight](tiny.png)\n"
    return Analysis(md, claims, {"rows": rows}, {"tiny.png": figure}, table=rows,
                    columns=["mechanism", "mean", "min", "max"])


TINY = Study(
    name="tiny-test", title="Max weight, tiny", doc="Softmax saturation at d_k = 4, 16 keys.",
    stores={"saturation": Trials("saturation", {"mechanism": ("scaled", "unscaled"),
                                                "seed": (0, 1)},
                                 {"d_k": 4, "n": 16, "trials": 10})},
    quick={"saturation": Trials("saturation", {"mechanism": ("scaled", "unscaled"),
                                               "seed": (0,)}, {"d_k": 4, "n": 16, "trials": 10})},
    quick_doc="one seed", analyse=_analyse, summary="tiny.json", figures=("tiny.png",),
    options=(Option("--mechanisms", "mechanism", "comma-separated mechanisms"),
             Option("--trials", "trials", "draws per cell", axis=False, minimum=1)))


@pytest.fixture
def tiny():
    register(TINY)
    try:
        yield TINY
    finally:
        del STUDIES[TINY.name]


def test_a_study_registered_from_a_test_file_runs_resumes_and_redraws(cli, tiny, tmp_path):
    out = tmp_path / "tiny"
    code, stdout, err = cli("study", "tiny-test", "--out", str(out), "--workers", "1", "--json")
    assert code == 0, err
    printed = json.loads(stdout)
    assert printed["runs"] == {"saturation": {"ok": 4, "failed": 0, "pending": 0}}
    (claim,) = printed["claims"]
    assert claim["verdict"] == "agrees" and claim["agrees"] is True   # 0.17 vs 0.04 at d_k 4
    assert folder_marks(out) == {"command": "attnscale study tiny-test", "study": "tiny-test"}
    found = load_study(out)  # the --include contract
    assert found.title == "Max weight, tiny" and found.figures == ("tiny.png",)
    assert found.claims == tuple(printed["claims"])
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    code, stdout, err = cli("study", "tiny-test", "--resume", str(out), "--json")
    assert code == 0 and json.loads(stdout)["claims"] == printed["claims"], err
    (out / "fragment.md").unlink()
    code, _, err = cli("study", "tiny-test", "--from", str(out))
    assert code == 0, err
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before  # redrawn byte for byte, nothing re-run
    code, stdout, _ = cli("study", "--list")
    assert code == 0 and "tiny-test: Max weight, tiny" in stdout
    assert "saturation, mechanism (2) x seed (2) = 4 trials" in stdout


def test_a_metric_edited_to_nan_or_null_stops_the_redraw_naming_file_line_and_field(cli, tiny,
                                                                                     tmp_path):
    out = tmp_path / "tiny"
    assert cli("study", "tiny-test", "--out", str(out), "--workers", "1")[0] == 0
    fragment = (out / "fragment.json").read_bytes()
    good = (out / "results.jsonl").read_text()
    for token in ("NaN", "null"):
        (out / "results.jsonl").write_text(good.replace('"max_weight_mean": ',
                                                        f'"max_weight_mean": {token}, "x": ', 1))
        code, _, err = cli("study", "tiny-test", "--from", str(out), "--force")
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert "results.jsonl" in err and "line 1" in err and "'result.max_weight_mean'" in err
        assert (out / "fragment.json").read_bytes() == fragment   # no null drawn into it


def test_quick_and_explicit_options(cli, tiny, tmp_path):
    out = tmp_path / "q"
    code, _, err = cli("study", "tiny-test", "--out", str(out), "--quick", "--mechanisms",
                       "scaled", "--trials", "12", "--workers", "1")
    assert code == 0, err
    spec = sweep.load(out).spec
    assert spec.grid == {"mechanism": ["scaled"], "seed": [0]}
    assert spec.fixed["trials"] == 12
    lines = (out / "results.jsonl").read_text()
    # The same settings, one of them written out explicitly: the same study, continued.
    code, _, err = cli("study", "tiny-test", "--out", str(out), "--quick", "--mechanisms",
                       "scaled", "--trials", "12", "--set", "n=16", "--workers", "1")
    assert code == 0 and (out / "results.jsonl").read_text() == lines, err
    code, _, err = cli("study", "tiny-test", "--out", str(out), "--workers", "1")
    assert code == 2 and "holds the quick tiny-test study under other settings" in err


@pytest.mark.parametrize("text", ["not json", "[]", "{}", '{"stores": {"saturation": 1}}'])
def test_a_damaged_study_file_is_a_one_line_error_and_changes_nothing(cli, tiny, tmp_path, text):
    out = tmp_path / "s"
    assert cli("study", "tiny-test", "--out", str(out), "--workers", "1")[0] == 0
    (out / launcher.STUDY_FILE).write_text(text)
    before = _snapshot(out)
    for argv in (["--out", str(out), "--force"], ["--resume", str(out)]):
        code, _, err = cli("study", "tiny-test", *argv, "--workers", "1")
        assert code == 2 and "study.json" in err and err.count("\n") == 1, err
    assert _snapshot(out) == before


def test_the_registry_refuses_a_second_study_of_one_name(tiny):
    with pytest.raises(ValueError, match="already registered"):
        register(dataclasses.replace(TINY, title="another"))
    with pytest.raises(ValueError, match="quick variant lacks"):
        register(dataclasses.replace(TINY, name="tiny-2", quick={}))
    with pytest.raises(ConfigError, match="Did you mean"):
        get("tiny-tst")


def test_the_analysis_refuses_to_pool_runs_of_another_setting(cli, tiny, tmp_path):
    out = tmp_path / "s"
    assert cli("study", "tiny-test", "--out", str(out), "--workers", "1")[0] == 0
    code, _, err = cli("sweep", "--resume", str(out), "--extend", "--grid", "n=16,32",
                       "--workers", "1")
    assert code == 0, err
    before = (out / "fragment.md").read_bytes()
    code, _, err = cli("study", "tiny-test", "--from", str(out))
    assert code == 2 and "differ in n (16, 32)" in err and err.count("\n") == 1, err
    assert (out / "fragment.md").read_bytes() == before


def _two_stores(stores):
    """The tiny analysis over both stores of a two-store study."""
    return _analyse({"saturation": [*stores["small"], *stores["large"]]})


TWO = dataclasses.replace(
    TINY, name="two-test",
    stores={"small": Trials("saturation", {"mechanism": ("scaled", "unscaled"), "seed": (0, 1)},
                            {"d_k": 4, "n": 16, "trials": 10}),
            "large": Trials("saturation", {"mechanism": ("scaled", "unscaled"), "seed": (0, 1)},
                            {"d_k": 8, "n": 16, "trials": 10})},
    quick={"small": Trials("saturation", {"mechanism": ("scaled", "unscaled"), "seed": (0,)},
                           {"d_k": 4, "n": 16, "trials": 10}),
           "large": Trials("saturation", {"mechanism": ("scaled", "unscaled"), "seed": (0,)},
                           {"d_k": 8, "n": 16, "trials": 10})},
    analyse=_two_stores)


def test_a_resume_uses_the_stored_settings_and_a_failed_one_changes_nothing(cli, tmp_path):
    register(TWO)
    try:
        out = tmp_path / "two"
        code, stdout, err = cli("study", "two-test", "--out", str(out), "--quick", "--workers",
                                "1", "--json")
        assert code == 0, err
        assert json.loads(stdout)["runs"] == {k: {"ok": 2, "failed": 0, "pending": 0}
                                              for k in ("small", "large")}
        # Ctrl-C before the second store started: the resume starts it on the stored (quick)
        # settings, though the study's default is the full one.
        shutil.rmtree(out / "large")
        code, stdout, err = cli("study", "two-test", "--resume", str(out), "--workers", "1",
                                "--json")
        assert code == 0, err
        assert sweep.load(out / "large").spec.grid["seed"] == [0]
        # A resume that fails (a store it cannot read) writes nothing, not even the first store.
        (out / "small" / "results.jsonl").write_text(
            (out / "small" / "results.jsonl").read_text().splitlines()[0] + "\n")
        (out / "large" / "sweep.json").write_text("{}")
        before = _snapshot(out)
        code, _, err = cli("study", "two-test", "--resume", str(out), "--workers", "1")
        assert code == 2 and "sweep.json" in err and err.count("\n") == 1, err
        assert _snapshot(out) == before
    finally:
        del STUDIES[TWO.name]


def test_include_says_k_of_n_runs_and_the_version(cli, tiny, tmp_path):
    from attnscale import __version__
    from attnscale.report.include import beyond_the_essay, load_studies
    out = tmp_path / "tiny"
    assert cli("study", "tiny-test", "--out", str(out), "--workers", "1")[0] == 0

    def line() -> str:
        (tmp_path / "fig").mkdir(exist_ok=True)
        for p in (tmp_path / "fig").iterdir():
            p.unlink()
        md = beyond_the_essay(load_studies([out]), tmp_path / "fig").markdown
        return next(x for x in md.splitlines() if "runs" in x and x.startswith("*"))

    assert line() == f"*4 of 4 runs; attnscale {__version__}.*"
    results = out / "results.jsonl"
    results.write_text("".join(results.read_text().splitlines(keepends=True)[:3]))
    assert line().startswith("*⚠️ 3 of 4 runs: 1 failed or never ran")
    spec = json.loads((out / "sweep.json").read_text())
    (out / "sweep.json").write_text(json.dumps({**spec, "attnscale": "0.0.1"}))
    assert f"⚠️ run by attnscale 0.0.1, not this report's {__version__}" in line()
    results.unlink()
    assert line().startswith("*⚠️ 0 of 4 runs")


# --- the rules, over every registered study -----------------------------------------------------

STUDY_NAMES = list(STUDIES)


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _a_value(study: Study, option: Option) -> str:
    """A valid command-line value of ``option``: the first of the full study's."""
    from attnscale.experiments import registry
    for trials in study.stores.values():
        grid, fixed = trials.resolved()
        value = grid[option.key][0] if option.key in grid else fixed.get(option.key)
        if value is None and option.key in registry.get(trials.experiment).params:
            value = registry.get(trials.experiment).params[option.key].default
        if value is not None:
            return repr(value) if isinstance(value, float) else str(value)
    # No default anywhere (a value read from the data when not given): the least one allowed.
    return "x" if option.minimum is None else f"{option.minimum:g}"


def _a_setting(study: Study, value: int) -> str:
    """A valid ``--set KEY=VALUE`` for ``study``: ``seed`` where a store has it, else the first
    integer setting with a default outside the grid of its first store."""
    from attnscale.experiments import registry
    params = [registry.get(t.experiment).params for t in study.stores.values()]
    if any("seed" in p for p in params):
        return f"seed={value}"
    first = next(iter(study.stores.values()))
    key = next(k for k, p in params[0].items() if p.type is int and not p.required
               and p.default is not None and k not in first.grid)
    return f"{key}={value}"


def _records_varying(study: Study, key: str, field: str) -> list[dict]:
    grid, fixed = study.stores[key].resolved()
    base = {k: v[0] for k, v in grid.items()}
    return [{"config": {**base, field: value}, "result": {}} for value in (1, 2)]


@pytest.mark.parametrize("name", STUDY_NAMES)
def test_no_study_pools_runs_that_differ_outside_its_grid(name):
    study = STUDIES[name]
    for key in study.stores:
        with pytest.raises(ConfigError, match="differ in not_an_axis"):
            launcher.check_pooling(study, key, _records_varying(study, key, "not_an_axis"))
        axis = next(iter(study.stores[key].grid))
        launcher.check_pooling(study, key, _records_varying(study, key, axis))  # shown: fine


@pytest.mark.parametrize("name", STUDY_NAMES)
def test_from_refuses_what_it_cannot_honour(cli, tmp_path, name):
    study = STUDIES[name]
    folder = tmp_path / "f"
    folder.mkdir()
    given = [("--workers", "2"), ("--ray", "auto"), ("--set", _a_setting(study, 3)), ("--quick",)]
    given += [(o.flag, _a_value(study, o)) for o in study.options]
    for argv in given:
        code, out, err = cli("study", name, "--from", str(folder), *argv)
        assert code == 2 and out == "" and err.count("\n") == 1, (argv, err)
        assert "--from only redraws" in err and argv[0] in err, (argv, err)
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("name", STUDY_NAMES)
def test_resume_refuses_options_it_cannot_honour_and_changes_nothing(cli, tiny, tmp_path, name):
    study = STUDIES[name]
    folder = tmp_path / "s"
    assert cli("study", "tiny-test", "--out", str(folder), "--workers", "1")[0] == 0
    before = _snapshot(folder)
    given = [[o.flag, _a_value(study, o)] for o in study.options] + [["--set", _a_setting(study, 0)],
                                                                     ["--quick"]]
    for argv in given:
        code, _, err = cli("study", name, "--resume", str(folder), *argv)
        assert code == 2 and "drop " + argv[0] in err and err.count("\n") == 1, (argv, err)
    if name != "tiny-test":  # another study's folder: refused, nothing written
        code, _, err = cli("study", name, "--resume", str(folder))
        assert code == 2 and "holds the tiny-test study" in err, err
    assert _snapshot(folder) == before


@pytest.mark.parametrize("name", STUDY_NAMES)
def test_one_folder_one_study_even_with_force(cli, tiny, tmp_path, name):
    folder = tmp_path / "s"
    assert cli("study", "tiny-test", "--out", str(folder), "--workers", "1")[0] == 0
    before = _snapshot(folder)
    code, _, err = cli("study", name, "--out", str(folder), "--force", "--workers", "1")
    assert code == 2 and "holds the tiny-test study" in err and err.count("\n") == 1, err
    assert _snapshot(folder) == before
    # A folder marked by another study but holding none of its files is free again.
    empty = tmp_path / "e"
    mark_folder(empty, study="tiny-test", command="attnscale study tiny-test")
    assert launcher._check_owner(STUDIES[name], empty, "--out") is None


@pytest.mark.parametrize("name", [n for n in STUDY_NAMES
                                  if any(o.axis for o in STUDIES[n].options)])
def test_explicit_options_win_over_quick(name):
    """``--quick --widths 64,128`` runs widths 64 and 128: what was given, not the default."""
    study = STUDIES[name]
    options = [o for o in study.options if o.axis]
    assert options
    for option in options:
        full = study.stores
        key = next(k for k, t in full.items() if option.key in t.grid)
        given = list(full[key].resolved()[0][option.key])
        plan = launcher.settings(study, quick=True, axes={option.key: given})
        assert plan[key]["grid"][option.key] == given


def test_every_study_parser_has_the_shared_options(cli):
    code, listed, _ = cli("study", "--list")
    assert code == 0
    for name in STUDY_NAMES:
        code, out, _ = cli("study", name, "--help")
        assert code == 0
        for flag in ("--out", "--resume", "--from", "--quick", "--workers", "--ray", "--set",
                     "--json", "--force"):
            assert re.search(rf"\s{flag}\b", out), (name, flag)
        # --list says what --quick runs for every study, and its grid
        entry = listed.split(f"{name}: ", 1)[1].split("\n\n", 1)[0]
        assert f"  --quick: {launcher.quick_doc(STUDIES[name])}\n" in entry, (name, entry)
        assert re.search(r"^  quick ", entry, re.M), (name, entry)


def test_a_study_without_its_own_quick_variant_runs_one_seed(cli, tmp_path):
    bare = register(dataclasses.replace(TINY, name="bare-test", quick=None, quick_doc=""))
    try:
        assert launcher.quick_doc(bare) == "the full grid on one seed (the first of each store's)"
        plan = launcher.settings(bare, quick=True)
        assert plan["saturation"]["grid"] == {"mechanism": ["scaled", "unscaled"], "seed": [0]}
        code, stdout, _ = cli("study", "bare-test", "--help")
        assert code == 0 and "--quick" in stdout
        one = dataclasses.replace(bare, stores={"saturation": Trials(
            "saturation", {"mechanism": ("scaled",), "seed": (0,)}, TINY.stores["saturation"].fixed)})
        with pytest.raises(ConfigError, match=r"no quick=True variant.*without quick=True\.$"):
            launcher.settings(one, quick=True)
    finally:
        del STUDIES["bare-test"]


def test_launcher_errors_spell_options_as_the_interface_that_raised_them(cli, tiny, tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as caught:
        launcher.run(TINY, folder, workers=1)
    assert str(caught.value).startswith("out ") and "pass force=True" in str(caught.value)
    assert "--" not in str(caught.value)
    code, _, err = cli("study", "tiny-test", "--out", str(folder), "--workers", "1")
    assert code == 2 and "--out " in err and "pass --force" in err and "=True" not in err, err
    with pytest.raises(ConfigError, match=r"^workers must be"):
        launcher.check_executor(0, None)
    code, _, err = cli("study", "tiny-test", "--out", str(tmp_path / "n"), "--workers", "0")
    assert code == 2 and "--workers must be" in err, err


# --- the search-grid edge ---------------------------------------------------------------------

@pytest.mark.parametrize("best, edge, expected", [
    ([1.0, 1.1], [False, False], None),
    ([0.8, 1.2], [True, False], "edge"),
    ([0.85, 1.55], [False, False], None),
    ([0.8, 1.6], [False, False], "spans"),
])
def test_a_best_value_at_the_search_grid_edge_is_inconclusive(best, edge, expected):
    why = claim_rules.search_inconclusive(best, edge, [0.8 + 0.05 * i for i in range(17)])
    assert (why is None) == (expected is None)
    if expected:
        assert why.startswith("inconclusive") and expected in why


def test_the_length_yarn_claims_at_the_edge_are_inconclusive():
    from attnscale.study.length import claims
    yarn = [{"factor": 2.0, "length": 32, "m": [1.0], "loss": [5.0],
             "fit": {"x": x, "y": 5.0, "edge": edge}} for x, edge in ((0.8, True), (1.6, True))]
    lm = [{"config": {"mechanism": "scaled", "seed": s, "seq_len": 16},
           "result": {"lengths": [16], "loss_at_length": [5.0], "yarn": [yarn[s]]}}
          for s in (0, 1)]
    (claim,) = [c for c in claims([], lm) if "YaRN" in c["quantity"]]
    assert claim["verdict"].startswith("inconclusive") and claim["agrees"] is False


def test_the_readme_adding_a_study_example_runs_and_redraws(cli, tmp_path):
    """The README's "Adding a study" file, as written, registers a study the launcher runs."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text.split("### Adding a study\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    try:
        study = namespace["STUDY"]
        assert STUDIES["max-weight"] is study
        out = tmp_path / "mw"
        done = launcher.run(study, out, fixed={"saturation": {"n": 16, "trials": 10}},
                            workers=1, show_progress=False)
        (claim,) = done.analysis.claims
        assert claim["verdict"] == "agrees"   # unscaled's max weight is far above scaled's
        assert load_study(out).claims == (claim,)
        rc, stdout, err = cli("study", "max-weight", "--from", str(out), "--json")
        assert rc == 0 and json.loads(stdout)["claims"] == [claim], err
    finally:
        STUDIES.pop("max-weight", None)
