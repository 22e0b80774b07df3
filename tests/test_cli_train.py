"""``attnscale train``, ``compare`` and ``study recall`` end to end, bad input, and Ctrl-C safety."""

from __future__ import annotations

import json

import pytest

import attnscale.experiments.recall.trainer as trainer
from attnscale.study.fragment import FRAGMENT_MD
from attnscale.study.launcher import STUDY_FILE
from attnscale.study.recall import FIGURE, STUDY, SUMMARY
from attnscale.report.include import load_study
from attnscale.io import LOCK, MANIFEST
from attnscale.sweep.store import RESULTS_FILE, SPEC_FILE

# A tiny model and run length: the CLI plumbing, not the science.
TINY = ("--d-k", "8", "--pairs", "4", "--steps", "5", "--batch-size", "4")
RUN_KEYS = ["mechanism", "seed", "steps_to_loss_1", "steps_to_loss_0_1", "final_loss",
            "eval_accuracy", "grad_wq_norm_step0", "plateaus", "wall_seconds", "loss_curve", "config"]


def test_compare_json_schema(cli):
    code, out, err = cli("compare", "--mechanisms", "scaled,unscaled", *TINY, "--json")
    assert code == 0 and err == ""               # no progress bar: stderr is not a terminal
    assert out.count("\n") == 1
    obj = json.loads(out)
    assert list(obj) == ["runs"] and [r["mechanism"] for r in obj["runs"]] == ["scaled", "unscaled"]
    for run in obj["runs"]:
        assert list(run) == RUN_KEYS
        assert run["seed"] == 0 and len(run["loss_curve"]) == 5
        assert run["steps_to_loss_0_1"] is None      # 5 steps never reach 0.1: null, not absent
        assert isinstance(run["plateaus"], list) and run["grad_wq_norm_step0"] > 0


def test_train_table_and_output_file(cli, tmp_path):
    out_file = tmp_path / "run.json"
    code, out, _ = cli("train", "--mechanism", "softcap", "--option", "cap=30", *TINY,
                       "--output", str(out_file))
    assert code == 0 and "softcap" in out and "steps_to_loss_0_1" in out
    assert [r["mechanism"] for r in json.loads(out_file.read_text())["runs"]] == ["softcap"]
    # no staging left behind; the manifest records run.json as attnscale's
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "run.json"]


def test_compare_prints_the_essay_ratios_and_plots(cli, tmp_path):
    png = tmp_path / "fig3.png"
    code, out, _ = cli("compare", *TINY, "--seed", "0,1", "--plot", str(png))
    assert code == 0 and out.count("unscaled/scaled") == 2 and "sqrt(d_k)" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_study_writes_table_figure_and_markdown(cli, tmp_path):
    code, out, _ = cli("study", "recall", "--out", str(tmp_path), "--mechanisms",
                       "scaled,qknorm", "--d-k", "4,8", "--seed", "0,1", "--pairs", "4",
                       "--steps", "4", "--batch-size", "4", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert {(r["mechanism"], r["d_k"]) for r in rows} == {(m, d) for m in ("scaled", "qknorm")
                                                          for d in (4, 8)}
    assert all(r["seeds"] == 2 for r in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        sorted([LOCK, MANIFEST, SPEC_FILE, RESULTS_FILE, STUDY_FILE, "fragment.json", FRAGMENT_MD,
                SUMMARY, FIGURE])
    md = (tmp_path / FRAGMENT_MD).read_text()
    assert "| qknorm |" in md and "d_k=8" in md
    assert len(json.loads((tmp_path / SUMMARY).read_text())["runs"]) == 8
    study = load_study(tmp_path)  # a finished study is a folder `reproduce --include` takes
    assert study.title == STUDY.title and FIGURE in study.markdown


@pytest.mark.parametrize("argv, fragment", [
    (("train", "--pairs", "40"), "pairs"),
    (("train", "--lr", "0"), "lr must be > 0"),
    (("train", "--lr=-3e-4"), "lr must be > 0"),
    (("train", "--steps", "0"), "steps must be >= 1"),
    (("train", "--mechanism", "qk_nrom"), "Did you mean: qknorm?"),
    (("train", "--option", "cap"), "key=value"),
    (("train", "--mechanism", "scaled", "--option", "cap=30"), "cap"),
    (("compare", "--mechanisms", "scaled,unscaeld"), "Did you mean: unscaled?"),
    (("compare", "--seed", "0,x"), "--seed"),
    (("compare", "--batch-size", "0"), "batch-size"),
    (("train", "--optimizer", "adamw"), "invalid choice"),
    (("train", "--steps", "ten"), "invalid int"),
    (("study", "recall", "--out", "x", "--d-k", "0"), "--d-k"),
])
def test_bad_options_exit_2_with_one_line(cli, argv, fragment):
    code, out, err = cli(*argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and fragment in err, err


@pytest.mark.parametrize("where", ["training", "writing"])
def test_ctrl_c_leaves_no_result_file(cli, tmp_path, monkeypatch, where):
    """Ctrl-C during training or half-way through writing: exit 130, no file, no staging."""
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "training":
        real, calls = trainer.StackedRecall.forward, []

        def forward(self, idx):
            calls.append(1)
            return interrupt() if len(calls) == 3 else real(self, idx)

        monkeypatch.setattr(trainer.StackedRecall, "forward", forward)
    else:
        monkeypatch.setattr(json, "dumps", interrupt)
    code, out, err = cli("compare", *TINY, "--output", str(tmp_path / "runs.json"))
    assert code == 130 and "interrupted" in err
    assert list(tmp_path.iterdir()) == []
