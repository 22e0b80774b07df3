"""The CLI end to end (in-process via ``attnscale.cli.main``), its bad inputs, and ``reproduce``."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnscale.io import MANIFEST
from attnscale.measure.montecarlo import saturation
from attnscale.report.reproduce import reproduce
from attnscale.report.sections import montecarlo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SAT_KEYS = {"mechanism", "d_k", "n", "trials", "seed", "max_weight_mean", "max_weight_se",
            "entropy_mean", "entropy_se", "jacobian_fro_mean", "jacobian_fro_se",
            "logit_std_mean"}
VAR_KEYS = {"d_k", "pairs", "seed", "std", "predicted", "rel_error", "std_ci95"}
SAT_ARGS = ("saturation", "--dk", "4,64", "--n", "32", "--trials", "20", "--seed", "0")
VAR_ARGS = ("variance", "--dk", "4,16", "--pairs", "1000", "--seed", "0")


def _one_json_object(out: str) -> dict:
    """``out`` is exactly one JSON object (json.loads rejects trailing data) plus a newline."""
    assert out.endswith("\n") and out.count("\n") == 1, out[-200:]
    obj = json.loads(out)
    assert isinstance(obj, dict) and list(obj) == ["rows"]
    return obj


# ---------------------------------------------------------------------------------------------
# --json and tables


def test_variance_json(cli):
    code, out, err = cli(*VAR_ARGS, "--json")
    assert code == 0 and err == ""            # no progress bar when stderr is not a terminal
    rows = _one_json_object(out)["rows"]
    assert [r["d_k"] for r in rows] == [4, 16]
    for r in rows:
        assert VAR_KEYS <= set(r)
        assert (r["pairs"], r["seed"]) == (1000, 0)
        assert r["predicted"] == math.sqrt(r["d_k"])
        ci = r["std_ci95"]
        assert isinstance(ci, list) and len(ci) == 2
        assert all(isinstance(x, float) for x in ci) and ci[0] < r["std"] < ci[1]


def test_saturation_json(cli):
    code, out, err = cli(*SAT_ARGS, "--json")
    assert code == 0 and err == ""
    rows = _one_json_object(out)["rows"]
    assert [(r["mechanism"], r["d_k"]) for r in rows] == [
        ("scaled", 4), ("unscaled", 4), ("scaled", 64), ("unscaled", 64)]
    for r in rows:
        assert SAT_KEYS <= set(r)
        assert (r["n"], r["trials"], r["seed"]) == (32, 20, 0)
    # The CLI is a thin layer: its rows are the API's rows.
    assert rows == saturation([4, 64], 32, 20, 0)


def test_saturation_json_mechanism_subset(cli):
    code, out, _ = cli(*SAT_ARGS, "--mechanisms", "unscaled", "--json")
    assert code == 0
    assert {r["mechanism"] for r in _one_json_object(out)["rows"]} == {"unscaled"}


@pytest.mark.parametrize("args, columns, n_rows", [
    (SAT_ARGS, ["mechanism", "d_k", "max_weight_mean", "entropy_mean", "jacobian_fro_mean"], 4),
    (VAR_ARGS, ["d_k", "pairs", "std", "predicted", "std_ci95"], 2),
])
def test_plain_output_is_a_table(cli, args, columns, n_rows):
    code, out, _ = cli(*args)
    assert code == 0
    lines = out.rstrip("\n").splitlines()
    assert len(lines) == 2 + n_rows
    header = lines[0].split()
    for col in columns:
        assert col in header
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert not out.lstrip().startswith("{")
    for line in lines[2:]:
        assert len(line) == len(lines[0])          # aligned columns


@pytest.mark.parametrize("args", [SAT_ARGS, VAR_ARGS])
def test_same_seed_gives_identical_json(cli, args):
    first = cli(*args, "--json")
    second = cli(*args, "--json")
    assert first[0] == 0 and first == second
    other = cli(*[a if a != "0" else "1" for a in args], "--json")   # --seed 1
    assert other[0] == 0 and other[1] != first[1]


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, one line naming the parameter, no traceback, nothing written


BAD_INPUTS = [
    (("variance", "--dk", "0"), r"--dk"),
    (("variance", "--dk", "-4"), r"--dk"),
    (("saturation", "--dk", "0"), r"--dk"),
    (("saturation", "--dk", "-4"), r"--dk"),
    (("saturation", "--dk", "4,,8"), r"--dk"),
    (("saturation", "--dk", "abc"), r"--dk"),
    (("saturation", "--dk", ""), r"--dk"),
    (("saturation", "--n", "0"), r"(--|\s)n\b"),
    (("saturation", "--n", "abc"), r"--n\b"),
    (("saturation", "--trials", "1"), r"trials"),
    (("saturation", "--seed", "-1"), r"seed"),
    (("variance", "--pairs", "1"), r"pairs"),
    (("saturation", "--mechanisms", "scaled,unscled"), r"mechanism.*Did you mean: unscaled\?"),
    (("saturation", "--mechanisms", "scaled,"), r"--mechanisms"),
    (("reproduce", "--seed", "-1"), r"seed"),
]


@pytest.mark.parametrize("argv, pattern", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(cli, tmp_path, monkeypatch, argv, pattern):
    monkeypatch.chdir(tmp_path)           # reproduce's default --out would land here
    code, out, err = cli(*argv)
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert err.startswith("attnscale ")
    assert re.search(pattern, err), err
    assert list(tmp_path.iterdir()) == []


def test_unwritable_out_exits_2_and_writes_nothing(cli, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    code, out, err = cli("reproduce", "--out", str(blocker / "report"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--out" in err and str(blocker / "report") in err
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]
    assert blocker.read_text() == "keep me"


def test_out_that_is_a_file_is_rejected(cli, tmp_path):
    target = tmp_path / "report.md"
    target.write_text("old")
    code, _, err = cli("reproduce", "--out", str(target))
    assert code == 2 and "--out" in err and err.count("\n") == 1
    assert target.read_text() == "old"


@pytest.mark.parametrize("command", ["variance", "saturation", "reproduce"])
def test_help_has_examples(cli, command):
    code, out, _ = cli(command, "--help")
    assert code == 0
    assert "examples:" in out
    examples = out.split("examples:", 1)[1]
    assert f"attnscale {command}" in examples


def test_top_level_help_lists_subcommands(cli):
    code, out, _ = cli("--help")
    assert code == 0
    for command in ("variance", "saturation", "reproduce"):
        assert command in out


def test_installed_console_script():
    """The one subprocess test: the entry point resolves, and its exit code and stderr are the
    ones ``main`` returns (one line, status 2, no traceback) once the console-script wrapper
    has turned them into a process exit."""
    script = Path(sys.executable).with_name("attnscale")
    assert script.exists(), script
    bad = subprocess.run([str(script), "saturation", "--dk", "4", "--mechanisms", "scaled,unscled"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr
    assert bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("attnscale saturation: error:")
    assert "Did you mean: unscaled?" in bad.stderr


# ---------------------------------------------------------------------------------------------
# reproduce end to end


@pytest.fixture(scope="module")
def montecarlo_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce") / "report"
    results = reproduce(out, 0, sections=(montecarlo.report_section,))
    return out, results


def test_reproduce_writes_all_files_and_no_staging(montecarlo_report):
    out, _ = montecarlo_report
    names = {p.name for p in out.iterdir()}
    assert {"figure1_saturation.png", "figure2_jacobian.png", "report.md",
            "results.json"} <= names
    assert [n for n in names if n.startswith(".")] == [MANIFEST]  # no staging dir, no probe file
    assert all(n.endswith(".png") for n in names - {"report.md", "results.json", MANIFEST})
    for png in (n for n in names if n.endswith(".png")):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_reproduce_results_json(montecarlo_report):
    out, results = montecarlo_report
    on_disk = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert on_disk == results
    assert on_disk["meta"]["seed"] == 0
    claims = on_disk["claims"]
    ids = [c["claim"] for c in claims]
    assert len(ids) == len(set(ids))
    # Every Monte Carlo claim of the essay is measured, with a CI where it is an estimate.
    for required in ("variance.std.dk64", "variance.max_rel_error", "jacobian.crossing_dk",
                     "saturation.unscaled.max_weight.dk1024", "small_head.n_threshold.dk4"):
        assert required in ids
    for c in claims:
        assert math.isfinite(c["ours"])
        assert c["agrees"] is True, c           # the essay's numbers reproduce at seed 0
        if c["se"] is not None:
            lo, hi = c["ci95"]
            assert lo <= c["ours"] <= hi
    experiments = {r["experiment"] for rows in on_disk["sections"].values() for r in rows}
    assert {"variance", "saturation", "jacobian_crossing", "small_head"} <= experiments


def test_reproduce_report_md(montecarlo_report):
    out, results = montecarlo_report
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "| section | quantity | essay | ours [95% CI] | verdict |" in md
    table = [line for line in md.splitlines() if line.startswith("| ") and "✅" in line]
    assert len(table) == len(results["claims"])
    assert all("agrees" in line for line in table)
    assert "❌" not in md
    assert "7.9774" in md
    assert re.search(r"!\[[^\]]*\]\(figure1_saturation\.png\)", md)
    assert re.search(r"!\[[^\]]*\]\(figure2_jacobian\.png\)", md)
    assert f"**{len(results['claims'])} of {len(results['claims'])} claims agree.**" in md


def test_reproduce_cli_with_all_registered_sections(cli, tmp_path):
    out = tmp_path / "rep"
    code, stdout, stderr = cli("reproduce", "--out", str(out), "--seed", "0")
    assert code == 0
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    claims = results["claims"]
    assert len(claims) >= 20
    assert len(stdout.splitlines()) == len(claims)
    assert all(line.startswith(("ok  ", "DIFF")) for line in stdout.splitlines())
    assert "claims agree" in stderr and str(out) in stderr
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "| section | quantity | essay |" in md
    for png in ("figure1_saturation.png", "figure2_jacobian.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
        assert f"]({png})" in md
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [MANIFEST]  # no staging
