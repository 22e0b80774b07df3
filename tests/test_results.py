"""The published studies in docs/results: every shipped study redraws from its store byte for
byte, the results page is up to date with the stores, and the pieces the page is drawn from (the
LM study's wide store, width claims and highest-LR table; ``attnscale results``) behave."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from attnscale.cli import main
from attnscale.study import get, launcher, page
from attnscale.study import lm as lm_study
from attnscale.study.fragment import FRAGMENT_JSON, FRAGMENT_MD

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
# The studies docs/results ships; each must be there, so that none is skipped silently.
SHIPPED = ("lm", "length", "recall")


def test_every_study_is_shipped():
    assert sorted(page.studies_in(RESULTS)) == sorted(SHIPPED)
    assert set(SHIPPED) == set(page.STUDY_FOLDERS)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_study_redraws_byte_for_byte(tmp_path, name):
    study = get(name)
    copy = tmp_path / name
    shutil.copytree(RESULTS / name, copy)
    for f in (FRAGMENT_MD, FRAGMENT_JSON, study.summary):
        (copy / f).unlink()
    launcher.redraw(study, copy)
    for f in (FRAGMENT_MD, FRAGMENT_JSON, study.summary):
        assert (copy / f).read_bytes() == (RESULTS / name / f).read_bytes(), f
    for fig in study.figures:  # each figure the shipped folder has is drawn again
        if (RESULTS / name / fig).exists():
            assert (copy / fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_page_is_up_to_date():
    shipped = (RESULTS / page.PAGE).read_text(encoding="utf-8")
    assert shipped == page.render(RESULTS), "run 'attnscale results docs/results'"


def test_results_page_numbers_come_from_the_stores():
    text = page.render(RESULTS)
    loaded = page.load(RESULTS)
    for name in SHIPPED:
        got = loaded[name]
        assert f"**{name}**: {got.ok} of {got.total} runs" in text
    rows = lm_study.sensitivity_rows(lm_study.study_records(loaded["lm"].records))
    scaled = next(r for r in rows if r["mechanism"] == "scaled")
    assert f"{scaled['mean']:.3f}" in text


def test_readme_links_the_results_page():
    readme = (RESULTS.parents[1] / "README.md").read_text(encoding="utf-8")
    head = "\n".join(readme.splitlines()[:30])
    assert "docs/results/README.md" in head


def test_reproduce_includes_the_shipped_studies(tmp_path):
    from attnscale.report.include import beyond_the_essay, load_studies
    studies = load_studies([str(RESULTS / name) for name in SHIPPED])
    section = beyond_the_essay(studies, tmp_path)
    claims = [r for r in section.rows if r["kind"] == "claim"]
    shipped = sum(len(json.loads((RESULTS / n / FRAGMENT_JSON).read_text())["claims"])
                  for n in SHIPPED)
    assert len(claims) == shipped > 0
    for c in claims:  # every beyond-essay claim is shown with its verdict
        assert c["verdict"] in section.markdown
    runs = {r["study"]: r["runs"] for r in section.rows if r["kind"] == "study"}
    assert set(runs) == set(SHIPPED)


# --- attnscale results ----------------------------------------------------------------------------

def _small_folder(tmp_path: Path) -> Path:
    """A folder holding a copy of the shipped length study alone."""
    root = tmp_path / "results"
    root.mkdir()
    shutil.copytree(RESULTS / "length", root / "length")
    return root


def test_results_command_writes_and_checks(tmp_path, capsys):
    root = _small_folder(tmp_path)
    assert main(["results", str(root), "--check"]) == 1       # no page yet
    assert main(["results", str(root)]) == 0
    text = (root / page.PAGE).read_text()
    assert "**lm**: not run yet" in text and "**length**:" in text
    assert main(["results", str(root), "--check"]) == 0
    (root / page.PAGE).write_text(text + "edited\n")
    assert main(["results", str(root), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    ([""], "DIR must be a path"),
    (["/no/such/folder"], "is not a folder"),
])
def test_results_command_bad_input(argv, match, capsys):
    assert main(["results", *argv]) == 2
    assert match in capsys.readouterr().err


def test_results_command_refuses_a_folder_without_studies(tmp_path, capsys):
    assert main(["results", str(tmp_path)]) == 2
    assert "holds none of the study folders" in capsys.readouterr().err


def test_results_command_keeps_a_page_it_did_not_write(tmp_path, capsys):
    root = _small_folder(tmp_path)
    (root / page.PAGE).write_text("my own notes\n")
    assert main(["results", str(root)]) == 2
    assert "did not write" in capsys.readouterr().err
    assert (root / page.PAGE).read_text() == "my own notes\n"
    assert main(["results", str(root), "--force"]) == 0
    assert (root / page.PAGE).read_text().startswith("# Which temperature mechanism")


# --- the LM study's wide store, width claims and highest LR ---------------------------------------

def _record(mechanism, lr, seed, loss, peak, width, diverged=False):
    trace = [{"step": s, "attn_logit_max": [peak * (s + 1) / 3], "entropy_min": [1.0]}
             for s in range(3)]
    return {"config": {"mechanism": mechanism, "options": {}, "lr": lr, "d_model": width,
                       "seed": seed, "n_layers": 2, "n_heads": 2, "seq_len": 16, "steps": 3,
                       "batch_size": 4},
            "loss_init": 5.0, "final_val_loss": loss, "diverged": diverged, "trace": trace}


def _widths_study(scaled_growth: float, qk_growth: float) -> list[dict]:
    """scaled and qk-layernorm at widths 16, 32 (2 seeds) and 64 (1 seed); the loss at the top
    LR rises by ``growth`` per width step, so LR sensitivity grows with width by that."""
    lrs = (1e-3, 1e-2, 1e-1)
    out = []
    for i, (width, seeds) in enumerate(((16, (0, 1)), (32, (0, 1)), (64, (0,)))):
        for seed in seeds:
            d = 0.01 * seed
            for name, growth in (("scaled", scaled_growth), ("qk-layernorm", qk_growth)):
                losses = (2.5 + d, 2.0 + d, 2.6 + d + 3 * growth * i)
                out += [_record(name, lr, seed, loss, 10.0 * (j + 1), width)
                        for j, (lr, loss) in enumerate(zip(lrs, losses))]
    return out


def test_width_claims_agree_when_scaled_grows_and_qk_layernorm_does_not():
    rows = lm_study.sensitivity_rows(_widths_study(0.3, 0.0))
    grows, less = lm_study.width_claims(rows)
    assert grows["verdict"] == "agrees" and grows["agrees"] is True
    # top-LR loss +0.6 at width 64 over width 16 -> sensitivity +0.6 / 3 lr values
    # top-LR loss 2.6 + 0.9 i at width index i, ℓ* = 2.0: sensitivity (1.1 + 0.9 i) / 3, so
    # 0.6 higher at width 64 (i = 2) than at width 16
    assert grows["ours"] == pytest.approx(0.6)
    assert "one seed" in grows["measured"]
    assert less["verdict"] == "agrees" and less["ours"] < 0


def test_width_claims_differ_when_qk_layernorm_grows_more():
    rows = lm_study.sensitivity_rows(_widths_study(0.0, 0.3))
    grows, less = lm_study.width_claims(rows)
    assert grows["agrees"] is False
    assert less["verdict"].startswith("differs") and less["ours"] > 0


def test_width_claims_need_two_widths():
    records = [r for r in _widths_study(0.3, 0.0) if r["config"]["d_model"] == 16]
    grows, less = lm_study.width_claims(lm_study.sensitivity_rows(records))
    assert grows["verdict"] == less["verdict"] == "not run"
    assert grows["agrees"] is None and less["agrees"] is None


def test_pair_claims_compare_where_both_ran_the_most_seeds():
    rows = lm_study.sensitivity_rows(_widths_study(0.3, 0.0))
    claim = lm_study._pair_claim(rows, "qk-layernorm", "scaled", "lower", "text")
    assert "width 16" in claim["measured"] and "width 32" in claim["measured"]
    assert "width 64" not in claim["measured"] and claim["ci"] is not None


def test_highest_lr_that_trains():
    lrs = (1e-3, 1e-2, 1e-1, 3e-1)
    records = []
    for seed in (0, 1):
        # best 2.0 at 1e-2; 2.15 at 1e-1 is within 10%; 3e-1 diverges on seed 1
        for lr, loss, peak in zip(lrs, (2.5, 2.0, 2.15, 2.1), (5.0, 20.0, 80.0 + seed, 900.0)):
            records.append(_record("scaled", lr, seed, loss, peak, 16,
                                   diverged=(lr == 3e-1 and seed == 1)))
    (row,) = lm_study.highest_lr_rows(records)
    assert row["lr"] == 1e-1 and row["loss"] == pytest.approx(2.15)
    assert row["best_loss"] == pytest.approx(2.0)
    assert row["peak_logit"] == pytest.approx(81.0)  # the larger over seeds
    assert row["within"] == lm_study.TRAINS_WITHIN


def test_highest_lr_none_when_nothing_is_finite():
    records = [_record("scaled", 1e-2, 0, None, 5.0, 16, diverged=True)]
    (row,) = lm_study.highest_lr_rows(records)
    assert row["lr"] is None and row["peak_logit"] is None
    assert lm_study._best_text(row) == "none"


def test_the_wide_store_runs_with_the_default_grid_only():
    study = get("lm")
    full = launcher.settings(study)
    assert set(full) == {"lm", "wide", "sinks"}
    assert full["wide"]["grid"]["d_model"] == list(lm_study.WIDE_WIDTHS)
    assert set(full["wide"]["grid"]["variant"]) <= set(full["lm"]["grid"]["variant"])
    assert set(full["sinks"]["grid"]["variant"]) <= set(full["lm"]["grid"]["variant"])
    assert full["sinks"]["fixed"]["steps"] == lm_study.SINK_STEPS
    custom = launcher.settings(study, axes={"d_model": [16]})
    assert set(custom) == {"lm"}
    assert set(launcher.settings(study, quick=True)) == {"lm"}
    paths = launcher.store_paths(study, "/x")
    assert paths == {"lm": Path("/x"), "wide": Path("/x/wide"), "sinks": Path("/x/sinks")}


def test_a_study_store_path_is_its_folder_setting():
    from attnscale.study.spec import Study, Trials
    two = Study("t", "t", "t", {"a": Trials("lm", {"seed": (0,)}),
                                "b": Trials("lm", {"seed": (0,)})},
                analyse=lambda s: None, summary="t.json", figures=())
    assert launcher.store_paths(two, "/x") == {"a": Path("/x/a"), "b": Path("/x/b")}


def test_registry_rules_for_default_only_stores():
    from attnscale.study.registry import register
    from attnscale.study.spec import Study, Trials
    base = {"a": Trials("lm", {"seed": (0,)}, folder=""),
            "b": Trials("lm", {"seed": (1,)}, folder="b", default_only=True)}
    with pytest.raises(ValueError, match="lacks store 'a'"):
        register(Study("t1", "t", "t", base, analyse=lambda s: None, summary="t.json",
                       figures=(), quick={"b": base["b"]}))
    with pytest.raises(ValueError, match="another folder"):
        register(Study("t2", "t", "t", base, analyse=lambda s: None, summary="t.json",
                       figures=(), quick={"a": Trials("lm", {"seed": (0,)}, folder="q")}))


def test_lm_fragment_shows_the_highest_lr_table(tmp_path):
    from attnscale.study.fragment import write_fragment
    records = [{"config": {}, "result": r} for r in _widths_study(0.3, 0.0)]
    analysis = lm_study.analyse({"lm": records[: len(records) // 2],
                                 "wide": records[len(records) // 2:]})
    assert analysis.tables["highest_lr"]
    files = write_fragment(tmp_path / "f", lm_study.STUDY, analysis)
    md = Path(files["fragment.md"]).read_text()
    assert "#### Highest learning rate that trains" in md
    assert "fewer seeds" in md
    claims = json.loads(Path(files["fragment.json"]).read_text())["claims"]
    assert any("grows with width" in c["quantity"] for c in claims)


def test_include_counts_the_runs_of_a_folder_store_and_its_subfolder_stores(tmp_path):
    from attnscale.report.include import _runs
    folder = tmp_path / "study"
    shutil.copytree(RESULTS / "recall", folder)
    (folder / "wide").mkdir()
    for name in ("sweep.json", "results.jsonl"):
        shutil.copyfile(RESULTS / "recall" / name, folder / "wide" / name)
    alone, _ = _runs("recall", RESULTS / "recall")
    both, _ = _runs("study", folder)
    assert both["ok"] == 2 * alone["ok"] and both["total"] == 2 * alone["total"]


def test_a_seed_part_way_through_its_lr_grid_is_left_out():
    records = _widths_study(0.3, 0.0)
    # scaled, width 16, seed 1 loses its top learning rate: that seed has not finished
    records = [r for r in records if not (r["config"]["mechanism"] == "scaled"
                                          and r["config"]["d_model"] == 16
                                          and r["config"]["seed"] == 1
                                          and r["config"]["lr"] == 1e-1)]
    rows = {(r["mechanism"], r["width"]): r for r in lm_study.sensitivity_rows(records)}
    cell = rows["scaled", 16]
    assert cell["seeds"] == 1 and cell["partial"] == 1 and len(cell["per_seed"]) == 1
    assert rows["qk-layernorm", 16]["partial"] == 0
    best = {(r["mechanism"], r["width"]): r for r in lm_study.highest_lr_rows(records)}
    assert best["scaled", 16]["seeds"] == 1 and best["scaled", 16]["partial"] == 1
    # with no finished seed at all, the cell reads partial
    records = [r for r in records if not (r["config"]["mechanism"] == "scaled"
                                          and r["config"]["d_model"] == 64
                                          and r["config"]["lr"] == 1e-1)]
    rows = {(r["mechanism"], r["width"]): r for r in lm_study.sensitivity_rows(records)}
    assert rows["scaled", 64]["mean"] is None and lm_study.sensitivity_text(rows["scaled", 64]) \
        == "partial"
    best = {(r["mechanism"], r["width"]): r for r in lm_study.highest_lr_rows(records)}
    assert lm_study._best_text(best["scaled", 64]) == "partial"


def test_the_lm_and_wide_stores_are_not_pooled_when_they_differ():
    from attnscale.errors import ConfigError
    records = [{"config": {"d_model": r["config"]["d_model"], "steps": 3}, "result": r}
               for r in _widths_study(0.3, 0.0)]
    lm = [r for r in records if r["config"]["d_model"] < 64]
    wide = [{**r, "config": {**r["config"], "steps": 50}} for r in records
            if r["config"]["d_model"] == 64]
    with pytest.raises(ConfigError, match="steps"):
        lm_study.analyse({"lm": lm, "wide": wide})
    assert lm_study.analyse({"lm": lm, "wide": [{**r, "config": {**r["config"], "steps": 3}}
                                                for r in wide]}).claims


def test_results_page_names_failed_runs_and_links_only_fragments_that_exist(tmp_path):
    root = _small_folder(tmp_path)
    (root / "length" / "fragment.md").unlink()
    store = root / "length" / "lm-length" / "results.jsonl"
    lines = store.read_text().splitlines()
    bad = json.loads(lines[0])
    bad.update(status="error", error="Traceback ...\nRuntimeError: boom", result=None)
    store.write_text("\n".join([json.dumps(bad), *lines[1:]]) + "\n")
    text = page.render(root)
    assert "1 failed: `attnscale sweep --resume length/lm-length --retry-errors`" in text
    assert "length/fragment.md" not in text
