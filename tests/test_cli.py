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
from attnscale.report.reproduce import reproduce
from attnscale.report.sections import montecarlo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, one line naming the parameter, no traceback, nothing written


BAD_INPUTS = [
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


@pytest.mark.parametrize("command", ["reproduce"])
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


def test_version_needs_no_command(cli):
    import attnscale

    code, out, err = cli("--version")
    assert (code, out, err) == (0, f"attnscale {attnscale.__version__}\n", "")
