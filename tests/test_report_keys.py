"""The entropy-vs-keys section (at init): the WLS slope and its CI, the planted-key Monte Carlo, a tiny section."""

from __future__ import annotations

import math

import pytest
import torch

from attnscale.constants import Z95
from attnscale.errors import ConfigError
from attnscale.measure.planted import PLANTED_MARGIN, planted_frame_qk, planted_key, planted_weight
from attnscale.mechanisms import MECHANISMS
from attnscale.mechanisms.ssmax import S_INIT
from attnscale.report.claims import CLAIMS_BY_ID
from attnscale.report.model import judge
from attnscale.report.reproduce import SECTIONS
from attnscale.report.sections import keys
from attnscale.report.sections.keys import build_section, keys_rows
from attnscale.stats import fit_line, t975
from attnscale.rng import rng

AT_INIT = [name for name, cls in MECHANISMS.items() if cls.defined_at_init]


# ---------------------------------------------------------------------------------------------
# fit_line and t975


def test_fit_line_matches_a_hand_computed_example():
    # x = 0, 1, 2; y = 0, 1, 3; se = 1: sum w = 3, sum wx = 3, sum wx^2 = 5, D = 6, so
    # b = (3 * 7 - 3 * 4) / 6 = 1.5, a = (5 * 4 - 3 * 7) / 6 = -1/6, var(b) = 3 / 6, and the
    # residuals 1/6, -1/3, 1/6 give chi2 = 1/6 < dof = 1: no inflation, 1.96 quantile.
    fit = fit_line([0, 1, 2], [0, 1, 3], [1, 1, 1])
    assert fit["slope"] == pytest.approx(1.5, abs=1e-12)
    assert fit["intercept"] == pytest.approx(-1 / 6, abs=1e-12)
    assert fit["chi2"] == pytest.approx(1 / 6, abs=1e-12) and fit["dof"] == 1
    assert fit["slope_se"] == pytest.approx(math.sqrt(0.5), abs=1e-12)
    lo, hi = fit["slope_ci95"]
    assert (lo, hi) == pytest.approx((1.5 - Z95 * math.sqrt(0.5), 1.5 + Z95 * math.sqrt(0.5)))


def test_fit_line_inflates_by_the_birge_ratio_and_uses_student_t():
    # Same points with se = 0.1: chi2 = 100 / 6 on 1 dof, so se(b) = sqrt(0.005) * sqrt(100 / 6)
    # = sqrt(1 / 12), the ordinary least-squares standard error; the CI uses t_{0.975, 1}.
    fit = fit_line([0, 1, 2], [0, 1, 3], [0.1, 0.1, 0.1])
    assert fit["birge"] == pytest.approx(math.sqrt(100 / 6))
    assert fit["slope_se"] == pytest.approx(math.sqrt(1 / 12))
    lo, hi = fit["slope_ci95"]
    assert hi - lo == pytest.approx(2 * t975(1) * math.sqrt(1 / 12))


def test_fit_line_weights_points_by_their_errors():
    # Two exact points on y = 2x + 1 and a wild one with a huge error: the line goes through the
    # precise points.
    fit = fit_line([0, 1, 2], [1, 3, 100], [1e-3, 1e-3, 1e3])
    assert fit["slope"] == pytest.approx(2.0, abs=1e-3)
    assert fit["intercept"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("x, y, se, pattern", [
    ([0], [1], [1], "at least 2"),
    ([0, 1], [1, 2], [1], "equal length"),
    ([0, 1], [1, 2], [1, 0], "positive"),
    ([0, 1], [1, math.nan], [1, 1], "finite"),
    ([1, 1], [1, 2], [1, 1], "distinct"),
])
def test_fit_line_refuses_bad_input(x, y, se, pattern):
    with pytest.raises(ConfigError, match=pattern):
        fit_line(x, y, se)


@pytest.mark.parametrize("dof, table", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (5, 2.5706),
                                        (10, 2.2281), (30, 2.0423)])
def test_t975_matches_the_t_table(dof, table):
    assert t975(dof) == pytest.approx(table, abs=1e-4)


def test_t975_tends_to_the_normal_quantile():
    assert t975(2000) == pytest.approx(Z95, abs=2e-3)
    with pytest.raises(ValueError, match="dof"):
        t975(0)


# ---------------------------------------------------------------------------------------------
# The planted key


def test_planted_frame_plants_the_margin():
    q, k = planted_frame_qk(16, 5, 7, 3.0, rng(0, "test"))
    raw = (q.double() @ k.double().transpose(-2, -1))[:, 0, 0, :]
    torch.testing.assert_close(raw[:, 0], torch.full((7,), 3.0 * 4.0, dtype=torch.float64),
                               rtol=1e-6, atol=0.0)


def test_planted_weight_is_the_softmax_weight_of_key_zero():
    z = torch.tensor([[2.0, 0.0, -1.0], [-1e4, 0.0, 1e4]], dtype=torch.float64)
    torch.testing.assert_close(planted_weight(z), torch.softmax(z, dim=-1)[:, 0])


@pytest.mark.parametrize("n", [2, 5])
def test_planted_key_matches_an_exact_float64_computation(n):
    d_k, trials, seed = 8, 40, 3
    rows = planted_key(n, d_k, trials, seed, ("scaled", "ssmax"))
    # The same draws, replayed, and the two rules written out in float64:
    # scaled z = q.k / sqrt(d), ssmax z = s ln(n) q.k / sqrt(d) (Nakanishi 2025).
    q, k = planted_frame_qk(d_k, n, trials, PLANTED_MARGIN, rng(seed, "planted", d_k, n))
    raw = (q.double() @ k.double().transpose(-2, -1))[:, 0, 0, :] / math.sqrt(d_k)
    for row, z in zip(rows, (raw, S_INIT * math.log(n) * raw)):
        p = torch.softmax(z, dim=-1)
        w = p[:, 0]
        entropy = -(p * torch.log(p)).sum(-1)
        got = torch.tensor([row["planted_weight_mean"], row["planted_weight_se"],
                            row["max_weight_mean"], row["entropy_mean"]], dtype=torch.float64)
        want = torch.stack([w.mean(), w.std() / math.sqrt(trials), p.amax(-1).mean(),
                            entropy.mean()])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert [(r["mechanism"], r["n"], r["trials"], r["margin"]) for r in rows] == \
        [(name, n, trials, PLANTED_MARGIN) for name in ("scaled", "ssmax")]


@pytest.mark.parametrize("kwargs, pattern", [
    ({"ns": [16, 16]}, "n"),
    ({"ns": 1}, "n"),
    ({"mechanisms": ["qk-layernorm"]}, "rotation invariant"),
    ({"mechanisms": ["init-reparam"]}, "at init"),
    ({"mechanisms": ["scaled", "scaled"]}, "mechanisms"),
    ({"trials": 1}, "trials"),
])
def test_planted_key_refuses_bad_input(kwargs, pattern):
    args = {"ns": 16, "d_k": 8, "trials": 4, "seed": 0, "mechanisms": ("scaled",), **kwargs}
    with pytest.raises(ConfigError, match=pattern):
        planted_key(**args)


# ---------------------------------------------------------------------------------------------
# A tiny section


def test_tiny_section(tmp_path):
    ns = (16, 128, keys.EXPONENT_MIN_N, 2 * keys.EXPONENT_MIN_N)
    sat, planted = keys_rows(0, ns=ns, d_k=8, trials=lambda n: 24, module_trials=lambda n: 8)
    section = build_section(tmp_path, sat, planted, seed=0)
    # The chi-square shortcut's mechanisms (scaled among them) at the claims' count, the others,
    # figure only, at their own; the text states both.
    counts = {r["mechanism"]: r["trials"] for r in sat}
    assert counts["scaled"] == counts["ssmax"] == 24 and counts["qknorm"] == counts["cosine"] == 8
    assert {c for m, c in counts.items() if m != "scaled"} == {24, 8}
    assert ", ".join(f"{n}: 24" for n in ns) in section.markdown
    assert ", ".join(f"{n}: 8" for n in ns) + " for qknorm" in section.markdown
    assert [r["mechanism"] for r in sat if r["n"] == ns[0]] == AT_INIT   # in registry order
    assert keys.report_section in SECTIONS
    png = tmp_path / "figure_keys_at_init.png"
    assert png.read_bytes().startswith(b"\x89PNG")
    assert [f for f, _ in section.figures] == [png.name]
    # Every mechanism defined at init, at every n; the planted key for scaled and ssmax.
    assert {(r["mechanism"], r["n"]) for r in sat} == {(m, n) for m in AT_INIT for n in ns}
    assert {(r["mechanism"], r["n"]) for r in planted} == \
        {(m, n) for m in keys.PLANTED_MECHANISMS for n in ns}
    for name in AT_INIT:
        assert f"| {name} |" in section.markdown
    # The measurements are the fits of the rows, and each claim gets a verdict.
    scaled = [r for r in sat if r["mechanism"] == "scaled"]
    fit = fit_line([math.log(r["n"]) for r in scaled], [r["entropy_mean"] for r in scaled],
                   [r["entropy_se"] for r in scaled])
    m = section.measurements["keys.scaled.entropy_slope"]
    assert m.value == pytest.approx(fit["slope"]) and m.interval() == pytest.approx(
        fit["slope_ci95"])
    tail = [r for r in planted if r["mechanism"] == "scaled" and r["n"] >= keys.EXPONENT_MIN_N]
    b = math.log(tail[1]["planted_weight_mean"] / tail[0]["planted_weight_mean"]) / math.log(2)
    assert section.measurements["keys.planted.scaled.exponent"].value == pytest.approx(b)
    for claim_id, meas in section.measurements.items():
        judge(CLAIMS_BY_ID[claim_id], meas)      # a Within claim: judged without error
    fits = {(r["experiment"], r["mechanism"]) for r in section.rows if "slope" in r}
    assert fits == {("entropy_slope", m) for m in AT_INIT} | \
        {("planted_exponent", m) for m in keys.PLANTED_MECHANISMS}


def test_trials_schedule_is_clamped():
    assert keys.trials_for(16) == keys.MAX_TRIALS
    assert keys.trials_for(1 << 30) == keys.MIN_TRIALS
    assert keys.trials_for(4096) == keys.KEY_BUDGET // 4096
    assert keys.module_trials_for(16) == keys.MAX_TRIALS
    assert keys.module_trials_for(1 << 30) == keys.MODULE_MIN_TRIALS
    assert keys.module_trials_for(4096) == keys.MODULE_KEY_BUDGET // 4096
