"""The report: verdict rules per check kind, the claims table, the all-or-nothing writer, the
sections' wiring and ``--include``."""

from __future__ import annotations

import inspect
import json
import math
import re
import tokenize
from functools import partial
from pathlib import Path

import pytest

import attnscale.report.sections
from attnscale.constants import Z95
from attnscale.errors import ConfigError
from attnscale.io import MANIFEST
from attnscale.report import Measurement, Section, judge
from attnscale.report.claims import (
    CLAIMS, CLAIMS_BY_ID, QUOTES, AtMost, Claim, Estimate, Exact, Within, essay,
)
from attnscale.report.include import load_studies
from attnscale.report.model import essay_value
from attnscale.report.reproduce import SECTIONS, reproduce
from attnscale.report.writer import claims_table, write_report

SQRT2 = math.sqrt(2.0)
SECTIONS_DIR = Path(attnscale.report.sections.__file__).parent
PNG_BYTES = b"\x89PNG\r\n\x1a\nfake image"


def claim(essay: str, check) -> Claim:
    return Claim("test.claim", "Test", "a test quantity", essay, check)


# ---------------------------------------------------------------------------------------------
# judge(): Estimate


def test_estimate_agrees_within_sqrt2_se_rule():
    c, se = claim("7.9774", Estimate()), 0.01
    half_unit = 5e-5                                   # half a unit in "7.9774"'s last digit
    limit = Z95 * SQRT2 * se + half_unit
    for diff in (0.0, 0.99 * limit, -0.99 * limit):
        v = judge(c, Measurement(7.9774 + diff, se=se))
        assert v.agrees and v.text.startswith("agrees"), (diff, v)
    for diff in (1.01 * limit, -1.01 * limit, 0.2):
        v = judge(c, Measurement(7.9774 + diff, se=se))
        assert not v.agrees and v.text.startswith("differs by"), (diff, v)
        assert ("+" if diff > 0 else "-") in v.text


def test_estimate_reports_gap_in_sd_units():
    v = judge(claim("0.749", Estimate()), Measurement(0.749 + 0.05, se=0.01))
    assert not v.agrees
    assert f"{0.05 / (SQRT2 * 0.01):+.1f} sd" in v.text          # +3.5 sd
    assert "+6.7%" in v.text                                       # 0.05 / 0.749


def test_estimate_half_unit_of_printed_precision_counts():
    # "11" is printed to the unit: a gap of 0.45 with a tiny se still agrees.
    c = claim("11", Estimate())
    assert judge(c, Measurement(11.45, se=1e-6)).agrees
    assert not judge(c, Measurement(11.55, se=1e-6)).agrees


def test_estimate_without_se_is_an_error():
    with pytest.raises(ValueError, match="se"):
        judge(claim("0.1", Estimate()), Measurement(0.1))


# ---------------------------------------------------------------------------------------------
# judge(): Exact, AtMost, Within


def test_exact_uses_relative_tolerance_plus_printed_precision():
    c = claim("5.545", Exact())
    assert judge(c, Measurement(math.log(256))).agrees          # 5.54518, within 5e-4
    v = judge(c, Measurement(5.546))
    assert not v.agrees and v.text.startswith("differs by +")
    tol = claim("11", Exact(rel=0.05))                            # 0.55 + 0.5 allowed
    assert judge(tol, Measurement(2 * math.log(256))).agrees
    assert judge(tol, Measurement(12.04)).agrees
    assert not judge(tol, Measurement(12.06)).agrees
    assert not judge(tol, Measurement(9.94)).agrees


def test_percent_values_are_parsed():
    assert essay_value(claim("0.5%", AtMost(0.005))) == 0.005
    assert essay_value(claim("7.9774", Estimate())) == 7.9774


def test_at_most_bound_and_within_noise():
    c = claim("0.5%", AtMost(0.005))
    assert judge(c, Measurement(0.004)).text == "agrees"
    assert judge(c, Measurement(0.005)).agrees                    # the bound itself
    noisy = judge(c, Measurement(0.006, ci95=(0.004, 0.008)))
    assert noisy.agrees and noisy.text.startswith("agrees within noise")
    noisy_se = judge(c, Measurement(0.0055, se=0.0005))          # CI from se: [0.00452, ...]
    assert noisy_se.agrees and "within noise" in noisy_se.text
    v = judge(c, Measurement(0.006, ci95=(0.0055, 0.007)))
    assert not v.agrees and v.text.startswith("differs")
    assert "0.001" in v.text                                      # the size of the gap
    assert not judge(c, Measurement(0.006)).agrees                # no CI: the point decides


def test_within_range_and_within_noise():
    c = claim("256-1024", Within(256, 1024))
    for value in (256, 400, 1024):
        assert judge(c, Measurement(value)).text == "agrees"
    noisy = judge(c, Measurement(200, ci95=(150, 300)))
    assert noisy.agrees and "within noise" in noisy.text
    above = judge(c, Measurement(1100, ci95=(1000, 1200)))
    assert above.agrees and "within noise" in above.text
    low = judge(c, Measurement(200, se=10))                       # CI [180.4, 219.6]
    assert not low.agrees and "56" in low.text                    # 256 - 200
    high = judge(c, Measurement(2000))
    assert not high.agrees and "976" in high.text


def test_measurement_interval():
    assert Measurement(1.0).interval() is None
    lo, hi = Measurement(1.0, se=0.1).interval()
    assert math.isclose(lo, 1.0 - Z95 * 0.1) and math.isclose(hi, 1.0 + Z95 * 0.1)
    assert Measurement(1.0, se=0.1, ci95=(0.5, 2.0)).interval() == (0.5, 2.0)


# ---------------------------------------------------------------------------------------------
# The claims table


def test_claim_ids_are_unique_and_indexed():
    ids = [c.id for c in CLAIMS]
    assert len(ids) == len(set(ids))
    assert set(CLAIMS_BY_ID) == set(ids)
    for c in CLAIMS:
        assert c.essay.strip() and c.quantity.strip() and c.section.strip()
        if isinstance(c.check, (Estimate, Exact)):  # the checks that compare with the value
            assert math.isfinite(essay_value(c))


def _cells(line: str) -> list[str]:
    """Split a markdown table row on unescaped pipes."""
    parts = re.split(r"(?<!\\)\|", line.strip())
    assert parts[0] == "" and parts[-1] == ""
    return [p.strip() for p in parts[1:-1]]


def test_claims_table_escapes_pipes_and_has_one_row_per_measured_claim():
    measurements = {
        "jacobian.scaled.mean": Measurement(0.0992, se=0.0004, note="a|b"),   # "||J||_F"
        "variance.std.dk64": Measurement(7.99, se=0.018),
        "saturation.unscaled.max_weight.dk64": Measurement(0.9, se=0.001),
    }
    table, records = claims_table(measurements)
    lines = table.splitlines()
    assert _cells(lines[0]) == ["section", "quantity", "essay", "ours [95% CI]", "verdict"]
    assert len(lines) == 2 + len(measurements)
    for line in lines[2:]:
        assert len(_cells(line)) == 5, line
    jac_line = next(line for line in lines if "J" in line)
    assert "\\|\\|J\\|\\|_F" in jac_line and "a\\|b" in jac_line
    assert [r["claim"] for r in records] == [c.id for c in CLAIMS if c.id in measurements]
    assert len({r["claim"] for r in records}) == len(records)
    by = {r["claim"]: r for r in records}
    assert by["variance.std.dk64"]["agrees"] is True
    assert by["saturation.unscaled.max_weight.dk64"]["agrees"] is False
    assert "✅" in jac_line
    assert "❌" in next(line for line in lines if "unscaled mean max weight, d_k=64" in line)
    lo, hi = by["variance.std.dk64"]["ci95"]
    assert math.isclose(lo, 7.99 - Z95 * 0.018) and math.isclose(hi, 7.99 + Z95 * 0.018)


# ---------------------------------------------------------------------------------------------
# write_report: all or nothing


def _good_section(fig_dir):
    (fig_dir / "fig.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    return Section(name="Good", rows=[{"x": 1}],
                   measurements={"variance.std.dk64": Measurement(7.98, se=0.018)},
                   figures=[("fig.png", "A figure")], markdown="Some prose.")


def test_write_report_writes_everything(tmp_path):
    out = tmp_path / "out"
    results = write_report(out, [_good_section], {"seed": 0})
    assert sorted(p.name for p in out.iterdir()) == [".attnscale-manifest.json", "fig.png",
                                                    "report.md", "results.json"]
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "![A figure](fig.png)" in md and "## Good" in md and "Some prose." in md
    assert "**1 of 1 claims agree.**" in md
    on_disk = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert on_disk == results
    assert on_disk["sections"] == {"Good": [{"x": 1}]}
    assert on_disk["claims"][0]["claim"] == "variance.std.dk64"


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_write_report_is_all_or_nothing(tmp_path, exc):
    out = tmp_path / "out"
    out.mkdir()

    def bad_section(fig_dir):
        (fig_dir / "half.png").write_bytes(b"\x89PNG")
        raise exc

    with pytest.raises(type(exc)):
        write_report(out, [_good_section, bad_section], {"seed": 0})
    assert list(out.iterdir()) == []     # no report.md, results.json, figures or staging dir


def test_write_report_failure_keeps_an_earlier_report(tmp_path):
    out = tmp_path / "out"
    write_report(out, [_good_section], {"seed": 0})
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def bad_section(fig_dir):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_report(out, [bad_section], {"seed": 1})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_write_report_refuses_a_claim_measured_by_two_sections(tmp_path):
    out = tmp_path / "out"
    out.mkdir()

    def twin(fig_dir):
        return Section(name="Twin", rows=[],
                       measurements={"variance.std.dk64": Measurement(7.98, se=0.018)})

    with pytest.raises(ValueError, match=r"Twin.*variance\.std\.dk64"):
        write_report(out, [_good_section, twin], {"seed": 0})
    assert list(out.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Unknown claim ids are errors, never dropped rows


def test_unknown_claim_id_is_an_error_where_the_section_is_built():
    with pytest.raises(ValueError, match=r"'variance\.std\.dk6'.*Did you mean: variance\.std\.dk64"):
        Section(name="Typo", rows=[], measurements={"variance.std.dk6": Measurement(8.0, se=0.1)})


def test_claims_table_refuses_an_unknown_id():
    with pytest.raises(ValueError, match=r"claims_table.*'no\.such\.claim'"):
        claims_table({"variance.std.dk64": Measurement(7.98, se=0.018),
                      "no.such.claim": Measurement(1.0)})


# ---------------------------------------------------------------------------------------------
# Every essay number is written once, in the claims module


def test_essay_reads_claims_and_quotes():
    assert essay("variance.std.dk64") == "7.9774"
    assert essay("recall.steps_to_loss_1.unscaled") == QUOTES["recall.steps_to_loss_1.unscaled"]
    with pytest.raises(ValueError, match="Did you mean"):
        essay("recall.steps_to_loss_1.scaledd")
    # A ratio claim derived from two quotes states them, and its value is their ratio.
    ratio = CLAIMS_BY_ID["recall.steps_to_loss_1.ratio"]
    scaled, unscaled = (QUOTES[f"recall.steps_to_loss_1.{m}"] for m in ("scaled", "unscaled"))
    assert f"essay {unscaled} / {scaled}" in ratio.quantity
    assert essay_value(ratio) == round(float(unscaled) / float(scaled), 2)


def _string_literals(path: Path) -> list[str]:
    with open(path, "rb") as f:
        return [tok.string for tok in tokenize.tokenize(f.readline) if tok.type == tokenize.STRING]


@pytest.mark.parametrize("module", sorted(p.name for p in SECTIONS_DIR.glob("*.py")))
def test_sections_do_not_restate_essay_numbers(module):
    """No string in a section spells a number the essay prints (they read it from claims)."""
    numbers = {v for v in QUOTES.values() if len(v) >= 3}
    numbers |= {c.essay for c in CLAIMS if c.section == "A Training Demo" and len(c.essay) >= 3}
    for literal in _string_literals(SECTIONS_DIR / module):
        for number in numbers:
            assert not re.search(rf"(?<![\w.]){re.escape(number)}(?![\w%])", literal), \
                (module, number, literal)


# ---------------------------------------------------------------------------------------------
# Sections are wired by imports


def test_sections_are_functions_of_the_sections_package():
    assert SECTIONS and all(callable(fn) for fn in SECTIONS)
    assert len(set(SECTIONS)) == len(SECTIONS)
    for fn in SECTIONS:
        assert fn.__module__.startswith("attnscale.report.sections."), fn
        assert list(inspect.signature(fn).parameters) == ["fig_dir", "seed", "full"], fn


@pytest.mark.parametrize("sections, pattern", [
    (("attnscale.report.sections.montecarlo:report_section",), "section functions"),
    ("attnscale.report.sections.montecarlo:report_section", "sequence of section functions"),
    ((), "non-empty"),
    ((_good_section, _good_section), "more than once"),
])
def test_reproduce_refuses_bad_sections_before_any_work(tmp_path, sections, pattern):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=pattern):
        reproduce(out, 0, sections=sections)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# --include DIR: finished studies as "Beyond the essay"

STUDY_CLAIMS = [
    {"quantity": "LR sensitivity, qk-layernorm vs scaled", "expected": "lower", "ours": 0.25,
     "ci": [0.1, 0.4], "verdict": "agrees", "agrees": True, "note": "2 seeds"},
    {"quantity": "a|b ratio", "expected": "0.1 ln s + 1", "ours": None, "verdict": "not measured",
     "agrees": False},
]


def _study(folder: Path, *, claims=STUDY_CLAIMS, title="Small-LM stability") -> Path:
    folder.mkdir(parents=True)
    (folder / "loss.png").write_bytes(PNG_BYTES)
    (folder / "unused.png").write_bytes(PNG_BYTES)
    (folder / "fragment.md").write_text(
        "Some findings.\n\n![Loss vs LR](loss.png)\n\nAgain: ![same](loss.png \"t\")\n",
        encoding="utf-8")
    meta = {"claims": claims} if title is None else {"title": title, "claims": claims}
    (folder / "fragment.json").write_text(json.dumps(meta), encoding="utf-8")
    return folder


def _cheap_section(fig_dir, *, seed, full):
    return _good_section(fig_dir)


def test_include_adds_a_beyond_the_essay_section(tmp_path):
    study = _study(tmp_path / "lm-study")
    out = tmp_path / "out"
    results = reproduce(out, 0, sections=(_cheap_section,), include=[study])
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "fig.png", "lm-study-loss.png",
                                                     "report.md", "results.json"]
    assert (out / "lm-study-loss.png").read_bytes() == PNG_BYTES
    md = (out / "report.md").read_text(encoding="utf-8")
    beyond = md.split("## Beyond the essay", 1)[1]
    assert "### Small-LM stability" in beyond and "Some findings." in beyond
    assert "![Loss vs LR](lm-study-loss.png)" in beyond
    assert '![same](lm-study-loss.png "t")' in beyond
    rows = [line for line in beyond.splitlines() if line.startswith("| ")]
    assert _cells(rows[0]) == ["quantity", "expected", "ours [95% CI]", "verdict"]
    assert _cells(rows[1]) == ["LR sensitivity, qk-layernorm vs scaled", "lower",
                               "0.25 [0.1, 0.4] (2 seeds)", "✅ agrees"]
    assert _cells(rows[2]) == ["a\\|b ratio", "0.1 ln s + 1", "—", "❌ not measured"]
    assert "**1 of 1 claims agree.**" in md          # the essay's count is the essay's claims only
    on_disk = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert on_disk == results
    got = on_disk["sections"]["Beyond the essay"]
    assert got[0] == {"kind": "study", "study": "lm-study", "title": "Small-LM stability",
                      "source": str(study.resolve()), "figures": ["lm-study-loss.png"],
                      "runs": None, "attnscale": None}
    assert "*⚠️ No runs: the folder holds no sweep store (no results.jsonl)" in beyond
    assert got[1:] == [{"kind": "claim", "study": "lm-study", **c} for c in STUDY_CLAIMS]


def test_include_title_defaults_to_the_folder_name_and_json_is_optional(tmp_path):
    with_json = _study(tmp_path / "a", title=None, claims=[])
    bare = tmp_path / "b"
    bare.mkdir()
    (bare / "fragment.md").write_text("Only prose.\n", encoding="utf-8")
    studies = load_studies([with_json, bare])
    assert [s.title for s in studies] == ["a", "b"]
    assert studies[1].claims == () and studies[1].figures == ()


def test_include_cli_prints_the_study_claims(cli, tmp_path, monkeypatch):
    import attnscale.cli.reproduce as command
    monkeypatch.setattr(command, "reproduce", partial(reproduce, sections=(_cheap_section,)))
    out = tmp_path / "out"
    code, stdout, stderr = cli("reproduce", "--out", str(out), "--include",
                               str(_study(tmp_path / "lm")))
    assert code == 0
    assert stdout.splitlines()[1:] == [
        "ok   [lm] LR sensitivity, qk-layernorm vs scaled: expected lower, ours 0.25 — agrees",
        "DIFF [lm] a|b ratio: expected 0.1 ln s + 1, ours — — not measured"]
    assert "Included studies: 1/2 of their claims agree." in stderr


def _bad_study(tmp_path: Path, case: str) -> list[str]:
    """``--include`` arguments for one broken case."""
    good = str(_study(tmp_path / "good"))
    folder = tmp_path / "bad"
    if case == "missing":
        return [str(folder)]
    if case == "empty path":
        return [""]
    if case == "a file":
        folder.write_text("x")
        return [str(folder)]
    if case == "repeated":
        return [good, good]
    if case == "same folder name":
        return [good, str(_study(tmp_path / "other" / "good"))]
    folder.mkdir()
    if case == "no fragment":
        (folder / "loss.png").write_bytes(PNG_BYTES)
        return [str(folder)]
    fragment, meta = "Prose.\n", None
    if case == "empty fragment":
        fragment = "  \n"
    elif case == "missing figure":
        fragment = "![x](gone.png)\n"
    elif case == "figure in a subfolder":
        (folder / "sub").mkdir()
        (folder / "sub" / "a.png").write_bytes(PNG_BYTES)
        fragment = "![x](sub/a.png)\n"
    elif case == "not a png":
        (folder / "a.png").write_text("not an image")
        fragment = "![x](a.png)\n"
    elif case == "remote image":
        fragment = "![x](https://example.org/a.png)\n"
    elif case == "bad json":
        meta = "{not json"
    elif case == "unknown json key":
        meta = json.dumps({"title": "t", "rows": []})
    elif case == "row missing a key":
        meta = json.dumps({"claims": [{k: v for k, v in STUDY_CLAIMS[0].items() if k != "agrees"}]})
    elif case == "row unknown key":
        meta = json.dumps({"claims": [{**STUDY_CLAIMS[0], "essay": "x"}]})
    elif case == "row bad ours":
        meta = json.dumps({"claims": [{**STUDY_CLAIMS[0], "ours": "0.25"}]})
    elif case == "row bad agrees":
        meta = json.dumps({"claims": [{**STUDY_CLAIMS[0], "agrees": "yes"}]})
    (folder / "fragment.md").write_text(fragment, encoding="utf-8")
    if meta is not None:
        (folder / "fragment.json").write_text(meta, encoding="utf-8")
    return [str(folder)]


BAD_STUDIES = {
    "missing": "does not exist", "empty path": "got ''", "a file": "is not a folder",
    "repeated": "more than once", "same folder name": "folder names.*more than once",
    "no fragment": "no fragment.md", "empty fragment": "fragment.md is empty",
    "missing figure": "'gone.png'", "figure in a subfolder": "directly in the study folder",
    "not a png": "not a PNG image", "remote image": "directly in the study folder",
    "bad json": "fragment.json is not JSON", "unknown json key": "'title' and 'claims' only",
    "row missing a key": "lacks 'agrees'", "row unknown key": "unknown key 'essay'",
    "row bad ours": "bad 'ours'", "row bad agrees": "bad 'agrees'",
}


@pytest.mark.parametrize("case", BAD_STUDIES)
def test_bad_include_exits_2_before_any_work(cli, tmp_path, monkeypatch, case):
    import attnscale.cli.reproduce as command
    ran = []
    monkeypatch.setattr(command, "reproduce", partial(
        reproduce, sections=(lambda fig_dir, *, seed: ran.append(seed),)))
    args = [a for path in _bad_study(tmp_path, case) for a in ("--include", path)]
    out = tmp_path / "out"
    code, stdout, stderr = cli("reproduce", "--out", str(out), *args)
    assert code == 2 and stdout == "" and not ran and not out.exists()
    assert stderr.count("\n") == 1 and "--include" in stderr, stderr
    assert re.search(BAD_STUDIES[case], stderr), stderr
