"""cli.study.study_sweep: the one home of the conventions every ``study`` command shares."""

from __future__ import annotations

import argparse

import pytest

import sweep_experiments  # noqa: F401  (registers test-marked)
from attnscale import sweep
from attnscale.cli.study import study_sweep
from attnscale.errors import ConfigError


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"out": None, "resume": None, "from_dir": None, "workers": 1,
                                 "ray": None, **given})


def _never(out, executor):
    raise AssertionError("only --out runs the grid")


def test_study_sweep_reads_checks_and_reports(tmp_path, capsys):
    store = tmp_path / "s"
    grid = {"mechanism": ["scaled"], "d_k": [4]}
    sweep.run("saturation", grid, store, fixed={"n": 16, "trials": 10}, workers=1)
    with pytest.raises(ConfigError, match="holds a 'saturation' sweep, not a recall study"):
        study_sweep(_args(from_dir=str(store)), "recall", "a recall study", _never)
    out, results = study_sweep(_args(from_dir=str(store)), "saturation", "it", _never)
    assert out == str(store) and len(results.ok) == 1 and capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="give one of --out DIR"):
        study_sweep(_args(out="a", from_dir="b"), "saturation", "it", _never)


def test_study_sweep_runs_with_out_and_reports_failed_runs(tmp_path, capsys):
    marks, store = tmp_path / "marks", tmp_path / "s"
    marks.mkdir()
    (marks / "fail-1").touch()

    def start(out, executor):
        assert executor == {"workers": 1, "ray_address": None}
        return sweep.run("test-marked", {"x": [0, 1]}, out, fixed={"marks": str(marks)},
                         **executor)

    out, results = study_sweep(_args(out=str(store)), "test-marked", "it", start)
    assert out == str(store) and len(results.ok) == 1 and len(results.failed) == 1
    assert "drawing 1 runs; 1 failed and 0 pending are left out" in capsys.readouterr().err
