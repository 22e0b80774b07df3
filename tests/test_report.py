"""The report: verdict rules per check kind, the claims table, and the all-or-nothing writer."""

from __future__ import annotations

import json
import math
import re

import pytest

from attnscale.constants import Z95
from attnscale.report import Measurement, Section, judge
from attnscale.report.claims import CLAIMS, CLAIMS_BY_ID, AtMost, Claim, Estimate, Exact, Within
from attnscale.report.model import essay_value
from attnscale.report.writer import claims_table, write_report

SQRT2 = math.sqrt(2.0)


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
