"""Monte Carlo experiments: the chi-square shortcut against direct sampling, determinism, bands.

Every statistical check is a band derived from the estimates' own standard errors at a fixed seed
(4 standard errors: a false alarm has probability ~6e-5 per comparison).
"""

from __future__ import annotations

import math

import pytest
import torch

from attnscale.errors import ConfigError
from attnscale.rng import rng
import attnscale.measure.montecarlo as montecarlo
from attnscale.measure.montecarlo import (
    jacobian_crossing, sample_gamma, sample_logits_direct, sample_normal, saturation,
    saturation_direct, small_head_thresholds, variance,
)
from peak_memory import peak_mib

BAND = 4.0
STAT_KEYS = ("max_weight", "entropy", "jacobian_fro", "logit_std")
SAT_KEYS = {"mechanism", "d_k", "n", "trials", "seed", "max_weight_mean", "max_weight_se",
            "entropy_mean", "entropy_se", "jacobian_fro_mean", "jacobian_fro_se",
            "logit_std_mean"}
VAR_KEYS = {"d_k", "pairs", "seed", "std", "predicted", "rel_error", "std_ci95"}


def assert_in_band(a: float, se_a: float, b: float, se_b: float, what: str) -> None:
    tol = BAND * math.sqrt(se_a ** 2 + se_b ** 2)
    assert abs(a - b) <= tol, f"{what}: {a} vs {b}, |diff| {abs(a - b):.3g} > {tol:.3g}"


# ---------------------------------------------------------------------------------------------
# The shortcut against direct sampling of q and K


@pytest.mark.parametrize("d_k, n, trials, mechanism", [
    (4, 16, 2000, "unscaled"),
    (64, 256, 800, "unscaled"),
    (64, 256, 800, "scaled"),
    (1024, 32, 400, "unscaled"),
])
def test_saturation_shortcut_matches_direct_sampling(d_k, n, trials, mechanism):
    fast, = saturation([d_k], n, trials, seed=11, mechanisms=(mechanism,))
    slow = saturation_direct(d_k, n, trials, seed=11, mechanism=mechanism)
    for key in STAT_KEYS:
        assert fast[f"{key}_se"] > 0 and slow[f"{key}_se"] > 0, key
        assert_in_band(fast[f"{key}_mean"], fast[f"{key}_se"], slow[f"{key}_mean"],
                       slow[f"{key}_se"], f"d_k={d_k} n={n} {mechanism} {key}")


def test_saturation_mean_and_se_match_an_independent_computation():
    """Means and standard errors against per-trial statistics computed here from raw q, K."""
    d_k, n, trials = 16, 64, 2000
    row, = saturation([d_k], n, trials, seed=5, mechanisms=("unscaled",))
    z = sample_logits_direct(d_k, n, trials, rng(99))
    p = torch.softmax(z, dim=-1)
    jac = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    per_trial = {"max_weight": p.max(-1).values, "entropy": -(p * p.log()).sum(-1),
                 "jacobian_fro": torch.linalg.matrix_norm(jac), "logit_std": z.std(-1)}
    for key, values in per_trial.items():
        mean, se = float(values.mean()), float(values.std() / math.sqrt(trials))
        assert_in_band(row[f"{key}_mean"], row[f"{key}_se"], mean, se, key)
        # The se of an se at 2000 trials is a few percent of it.
        assert 0.85 < row[f"{key}_se"] / se < 1.18, (key, row[f"{key}_se"], se)


@pytest.mark.parametrize("d_k", [4, 64, 256])
def test_variance_std_matches_direct_sampling(d_k):
    row, = variance([d_k], pairs=40_000, seed=2)
    raw = sample_logits_direct(d_k, 1, 40_000, rng(7, d_k))[:, 0]
    std = float(raw.std())
    kurt = 3.0 + 6.0 / d_k
    se_direct = std * math.sqrt((kurt - 1.0) / raw.numel()) / 2.0   # delta method, large N
    assert_in_band(row["std"], row["std_se"], std, se_direct, f"d_k={d_k}")
    assert abs(std - math.sqrt(d_k)) <= BAND * se_direct


# ---------------------------------------------------------------------------------------------
# The samplers behind the variance check


def _assert_cdf_bins(u: torch.Tensor, what: str, bins: int = 50) -> None:
    """``u`` = F(x) for samples x of a distribution with CDF F is uniform: every one of ``bins``
    equal bins holds its expected count within BAND binomial standard errors."""
    count = torch.histc(u, bins=bins, min=0.0, max=1.0)
    n, p = u.numel(), 1.0 / bins
    assert int(count.sum()) == n, what
    worst = float(((count - n * p).abs() / math.sqrt(n * p * (1 - p))).max())
    assert worst <= BAND, f"{what}: a bin is {worst:.2f} standard errors off"


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0, 32.0, 512.0])
def test_sample_gamma_has_the_gamma_distribution(alpha):
    n = 200_000
    x = sample_gamma(alpha, n, rng(0, "gamma", alpha))
    assert x.shape == (n,) and x.dtype == torch.float64
    assert bool((x > 0).all()) and bool(x.isfinite().all())   # every rejected draw was redrawn
    _assert_cdf_bins(torch.special.gammainc(torch.tensor(alpha, dtype=torch.float64), x),
                     f"Gamma({alpha})")
    # Mean and variance are both alpha; the mean's se is sqrt(alpha / n).
    assert abs(float(x.mean()) - alpha) <= BAND * math.sqrt(alpha / n)
    var_se = math.sqrt((2 * alpha ** 2 + 6 * alpha) / n)     # (mu_4 - sigma^4) / n
    assert abs(float(x.var()) - alpha) <= BAND * var_se


def test_sample_gamma_is_deterministic_per_stream():
    a = sample_gamma(3.0, 10_000, rng(1, "gamma"))
    b = sample_gamma(3.0, 10_000, rng(1, "gamma"))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sample_normal_is_standard_normal():
    z = sample_normal(200_001, rng(0, "normal"))
    assert z.shape == (200_001,) and z.dtype == torch.float64
    _assert_cdf_bins(torch.special.ndtr(z), "N(0, 1)")


# ---------------------------------------------------------------------------------------------
# Threads and batches do not change the rows


def test_rows_are_the_same_on_one_and_two_threads():
    before = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out.append((variance([4, 64, 256], 3000, seed=5),
                        saturation([4, 64, 256], [16, 100], 300, seed=5,
                                   mechanisms=("scaled", "unscaled", "ssmax"))))
    finally:
        torch.set_num_threads(before)
    assert out[0] == out[1]


def test_shortcut_batches_score_the_same_samples(monkeypatch):
    """The shortcut draws in chunks and scores them in batches; the batch size changes only the
    order of the floating-point sums, never the samples."""
    whole = saturation([16, 256], 64, 3000, seed=2)
    monkeypatch.setattr(montecarlo, "SHORTCUT_BATCH_ELEMENTS", 1)    # one draw per batch
    chunked = saturation([16, 256], 64, 3000, seed=2)
    for a, b in zip(whole, chunked):
        for key in STAT_KEYS:
            torch.testing.assert_close(a[f"{key}_mean"], b[f"{key}_mean"], rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# variance rows


def _kurtosis_se(d_k: int, count: int) -> float:
    """Delta-method se of the sample kurtosis m4/m2^2 for x = |q| g, from exact moments.

    ``E x^(2k) = (2k-1)!! d (d+2) ... (d+2k-2)``; the influence function of the kurtosis is
    ``(x^4 - m4)/m2^2 - 2 m4 (x^2 - m2)/m2^3``.
    """
    d = float(d_k)
    m2, m4 = d, 3 * d * (d + 2)
    m6, m8 = 15 * d * (d + 2) * (d + 4), 105 * d * (d + 2) * (d + 4) * (d + 6)
    c = m4 / m2
    var_if = ((m8 - m4 ** 2) - 4 * c * (m6 - m4 * m2) + 4 * c ** 2 * (m4 - m2 ** 2)) / m2 ** 4
    return math.sqrt(var_if / count)


def test_variance_rows_keys_ci_and_bands():
    d_ks, pairs = [4, 16, 64, 1024], 100_000
    rows = variance(d_ks, pairs, seed=0)
    assert [r["d_k"] for r in rows] == d_ks
    for r in rows:
        d = r["d_k"]
        assert VAR_KEYS <= set(r), set(r)
        assert r["pairs"] == pairs and r["seed"] == 0
        assert r["predicted"] == math.sqrt(d)
        assert math.isclose(r["rel_error"], r["std"] / math.sqrt(d) - 1.0, rel_tol=1e-12)
        lo, hi = r["std_ci95"]
        assert isinstance(lo, float) and isinstance(hi, float)
        assert lo < r["std"] < hi
        # Log-scale interval: symmetric around ln s, half-width 1.96 se(s) / s.
        assert math.isclose(math.log(hi / lo), 2 * 1.959963984540054 * r["std_se"] / r["std"],
                            rel_tol=1e-9)
        assert math.isclose(math.sqrt(lo * hi), r["std"], rel_tol=1e-12)
        # se of a sample std under kurtosis k: sigma sqrt((k - 1)/N)/2, independently of the code.
        se = math.sqrt(d) * math.sqrt((2.0 + 6.0 / d) / pairs) / 2.0
        assert math.isclose(r["std_se"], se, rel_tol=0.02), (r["std_se"], se)
        assert abs(r["std"] - math.sqrt(d)) <= BAND * r["std_se"], r
        assert r["kurtosis_theory"] == 3.0 + 6.0 / d
        assert abs(r["kurtosis_measured"] - (3.0 + 6.0 / d)) <= BAND * _kurtosis_se(d, pairs), r


def test_variance_kurtosis_widens_the_ci():
    # At d_k = 4 the kurtosis is 4.5, so the CI is sqrt(3.5/2) ~ 1.32x the Gaussian one.
    r, = variance([4], 50_000, seed=1)
    gaussian = r["std"] / math.sqrt(2 * 50_000)
    assert math.isclose(r["std_se"] / gaussian, math.sqrt(3.5 / 2.0), rel_tol=1e-3)


# ---------------------------------------------------------------------------------------------
# Determinism and independence of rows


def test_same_seed_gives_identical_rows():
    assert saturation([4, 64], 32, 50, seed=3) == saturation([4, 64], 32, 50, seed=3)
    assert variance([4, 64], 500, seed=3) == variance([4, 64], 500, seed=3)


def test_row_does_not_depend_on_other_requested_d_ks():
    alone = saturation([64], 32, 50, seed=3)
    among = saturation([4, 64, 256], 32, 50, seed=3)
    assert [r for r in among if r["d_k"] == 64] == alone
    v_alone = variance([64], 500, seed=3)
    v_among = variance([256, 64, 4], 500, seed=3)
    assert [r for r in v_among if r["d_k"] == 64] == v_alone


def test_row_does_not_depend_on_other_requested_mechanisms():
    both = saturation([16], 32, 50, seed=4, mechanisms=("scaled", "unscaled"))
    only = saturation([16], 32, 50, seed=4, mechanisms=("unscaled",))
    assert [r for r in both if r["mechanism"] == "unscaled"] == only


def test_different_seeds_differ():
    a, b = saturation([16], 32, 50, seed=0), saturation([16], 32, 50, seed=1)
    for ra, rb in zip(a, b):
        assert ra["max_weight_mean"] != rb["max_weight_mean"]
        assert ra["entropy_mean"] != rb["entropy_mean"]
    assert variance([16], 500, seed=0)[0]["std"] != variance([16], 500, seed=1)[0]["std"]


def test_saturation_rows_have_required_keys_and_sane_values():
    rows = saturation([4, 256], 64, 20, seed=0)
    assert [(r["mechanism"], r["d_k"]) for r in rows] == [
        ("scaled", 4), ("unscaled", 4), ("scaled", 256), ("unscaled", 256)]
    for r in rows:
        assert SAT_KEYS <= set(r), set(r)
        assert (r["n"], r["trials"], r["seed"]) == (64, 20, 0)
        assert 1 / 64 <= r["max_weight_mean"] <= 1.0
        assert 0.0 <= r["entropy_mean"] <= math.log(64) + 1e-12
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))


def test_single_key_is_one_hot():
    for r in saturation([8], 1, 5, seed=0):
        assert r["max_weight_mean"] == 1.0 and r["max_weight_se"] == 0.0
        assert r["entropy_mean"] == 0.0 and r["jacobian_fro_mean"] == 0.0
        assert r["logit_std_mean"] == 0.0


# ---------------------------------------------------------------------------------------------
# Bounded memory


_SETUP = "from attnscale.measure.montecarlo import saturation, variance"


def test_large_n_runs_in_bounded_memory():
    """Peak resident memory (torch's allocations included) stays a fraction of the whole
    (trials, n) float64 logit array, which the trials never form at once."""
    n, trials = 2 ** 16, 64
    full = n * trials * 8 / 2 ** 20  # MiB: 32
    peak = peak_mib(_SETUP, f"saturation([64], {n}, {trials}, seed=0)",
                    warm="saturation([64], 1024, 8, seed=0)")
    assert peak < full / 4, f"peak {peak:.1f} MiB"
    for r in saturation([64], n, trials, seed=0):
        assert 0.0 < r["max_weight_mean"] <= 1.0
        assert math.isfinite(r["entropy_mean"]) and math.isfinite(r["jacobian_fro_mean"])


def test_the_memory_probe_sees_torch_allocations():
    """The check above can fail: a (trials, n) float64 torch array at the same sizes shows."""
    peak = peak_mib("import torch", "x = torch.randn(64, 2 ** 16, dtype=torch.float64)\n"
                                    "x = x.exp()")
    assert peak > 32


def test_large_n_few_trials():
    rows = saturation([64], 2 ** 16, 4, seed=0)
    for r in rows:
        assert 0.0 < r["max_weight_mean"] <= 1.0 and r["trials"] == 4
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))


# ---------------------------------------------------------------------------------------------
# Jacobian crossing on synthetic rows


def _rows(d_ks, unscaled, scaled, se=0.0):
    out = []
    for d, u, s in zip(d_ks, unscaled, scaled):
        out.append({"mechanism": "unscaled", "d_k": d, "jacobian_fro_mean": u,
                    "jacobian_fro_se": se})
        out.append({"mechanism": "scaled", "d_k": d, "jacobian_fro_mean": s,
                    "jacobian_fro_se": se})
    return out


def test_crossing_interpolates_in_log2_dk():
    rows = _rows([4, 16, 64, 256], [0.2, 0.3, 0.2, 0.05], [0.1] * 4)
    c = jacobian_crossing(rows)
    assert c["crosses"] is True and c["d_k_interval"] == [64, 256]
    t = 0.1 / 0.15  # fraction of the log2 step where 0.1 -> -0.05 hits 0
    assert math.isclose(c["d_k_estimate"], 2 ** (6 + 2 * t), rel_tol=1e-12)
    assert c["d_k_ci95"] == [c["d_k_estimate"], c["d_k_estimate"]]  # se = 0


def test_no_crossing():
    c = jacobian_crossing(_rows([4, 16, 64], [0.2, 0.3, 0.2], [0.1] * 3, se=0.01))
    assert c == {"crosses": False, "d_k_interval": None, "d_k_estimate": None, "d_k_ci95": None}
    # Lower curve below from the start: no crossing *from above* either.
    assert not jacobian_crossing(_rows([4, 16], [0.05, 0.04], [0.1, 0.1]))["crosses"]


def test_crossing_uses_the_last_sign_change():
    c = jacobian_crossing(_rows([4, 16, 64, 256, 1024], [0.2, 0.05, 0.2, 0.2, 0.05], [0.1] * 5))
    assert c["d_k_interval"] == [256, 1024]


def test_crossing_ci_is_ordered_and_contains_estimate():
    rows = _rows([4, 16, 64, 256, 1024], [0.3, 0.25, 0.15, 0.08, 0.02], [0.1] * 5, se=0.005)
    c = jacobian_crossing(rows)
    lo, hi = c["d_k_ci95"]
    assert c["d_k_interval"] == [64, 256]
    assert lo < c["d_k_estimate"] < hi
    assert 64 <= lo and hi <= 256
    wider = jacobian_crossing(_rows([4, 16, 64, 256, 1024], [0.3, 0.25, 0.15, 0.08, 0.02],
                                    [0.1] * 5, se=0.01))["d_k_ci95"]
    assert wider[0] < lo and wider[1] > hi


def test_crossing_ci_is_not_cut_at_the_estimate_when_a_shifted_curve_never_crosses():
    # Difference 0.2, 0.1, -0.01 with se 0.01 + 0.01: shifted up by 1.96 * 0.02 it stays > 0 on
    # the grid, so the crossing may lie beyond d_k = 64.  The 95% CI must not end at the point
    # estimate (that would claim the crossing is <= the estimate with 97.5% confidence).
    c = jacobian_crossing(_rows([4, 16, 64], [0.3, 0.2, 0.09], [0.1] * 3, se=0.01))
    assert c["crosses"] is True
    lo, hi = c["d_k_ci95"] if c["d_k_ci95"] is not None else (None, None)
    assert lo is not None and lo < c["d_k_estimate"]
    assert hi is None or hi > c["d_k_estimate"], c


# ---------------------------------------------------------------------------------------------
# Small-head thresholds


def test_small_head_thresholds():
    th = small_head_thresholds(256, 4)
    assert th["n"] == 256 and th["d_k"] == 4
    assert math.isclose(th["d_k_threshold"], 2 * math.log(256), rel_tol=1e-15)
    assert math.isclose(th["d_k_threshold"], 11.09035488895912, rel_tol=1e-12)   # "about 11"
    assert math.isclose(th["n_threshold"], math.exp(2.0), rel_tol=1e-15)           # "about 7"
    assert math.isclose(th["sigma_threshold"], math.sqrt(2 * math.log(256)), rel_tol=1e-15)
    assert math.isclose(small_head_thresholds(1024, 10)["n_threshold"], math.exp(5.0))


def test_small_heads_stay_unsaturated_below_the_threshold():
    # Unscaled d_k = 4 over n = 256 keys is far from one-hot; over n = 4 < exp(2) keys the top
    # key takes most of the mass.
    wide, = saturation([4], 256, 400, seed=0, mechanisms=("unscaled",))
    narrow, = saturation([4], 4, 400, seed=0, mechanisms=("unscaled",))
    assert wide["max_weight_mean"] + BAND * wide["max_weight_se"] < 0.3
    assert narrow["max_weight_mean"] - BAND * narrow["max_weight_se"] > 0.5


# ---------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("call, param", [
    (lambda: saturation([0], 8, 4, 0), "d_ks"),
    (lambda: saturation([4, -4], 8, 4, 0), "d_ks"),
    (lambda: saturation([], 8, 4, 0), "d_ks"),
    (lambda: saturation([4.5], 8, 4, 0), "d_ks"),
    (lambda: saturation([True], 8, 4, 0), "d_ks"),
    (lambda: saturation([4], True, 4, 0), "n"),
    (lambda: variance([4], True, 0), "pairs"),
    (lambda: saturation([4], 0, 4, 0), "n"),
    (lambda: saturation([4], [8, 0], 4, 0), "n"),
    (lambda: saturation([4], [], 4, 0), "n"),
    (lambda: saturation([4], 8, 1, 0), "trials"),
    (lambda: saturation([4], 8, 4, -1), "seed"),
    (lambda: saturation([4], 8, 4, 0, ()), "mechanisms"),
    (lambda: saturation([4], 8, 4, 0, [""]), "mechanisms"),
    (lambda: saturation_direct(0, 8, 4, 0), "d_k"),
    (lambda: saturation_direct(4, 8, 1, 0), "trials"),
    (lambda: variance([0], 100, 0), "d_ks"),
    (lambda: variance("4,8", 100, 0), "d_ks"),
    (lambda: variance([4], 1, 0), "pairs"),
    (lambda: variance([4], 100, -1), "seed"),
    (lambda: small_head_thresholds(1, 4), "n"),
    (lambda: small_head_thresholds(256, 0), "d_k"),
])
def test_bad_arguments_raise_value_error_naming_the_parameter(call, param):
    with pytest.raises(ValueError) as err:
        call()
    assert isinstance(err.value, ConfigError)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.split()[0].strip("'") == param or f" {param} " in f" {msg} ", msg


def test_unknown_mechanism_suggests_a_close_name():
    with pytest.raises(ConfigError, match=r"Did you mean: unscaled\?") as err:
        saturation([4], 8, 4, 0, mechanisms=("scaled", "unscled"))
    assert "mechanism" in str(err.value) and "'unscled'" in str(err.value)
    with pytest.raises(ValueError, match="Did you mean: scaled"):
        saturation_direct(4, 8, 4, 0, mechanism="scaeld")


def test_mechanism_names_are_checked_by_the_registry_check():
    # The one name check (attnscale.mechanisms.check_mechanism), prefixed by the parameter.
    with pytest.raises(ConfigError, match=r"^mechanisms: Unknown mechanism 'unscled'\. "
                                          r"Did you mean: unscaled\? Choices: "):
        saturation([4], 8, 4, 0, mechanisms=("scaled", "unscled"))
    with pytest.raises(ConfigError, match=r"^mechanism: Unknown mechanism 'scaeld'\. "):
        saturation_direct(4, 8, 4, 0, mechanism="scaeld")


# Repeated entries: a statistic never merges two requests.
@pytest.mark.parametrize("call, param, value", [
    (lambda: saturation([4], 8, 4, 0, ["scaled", "scaled"]), "mechanisms", "'scaled'"),
    (lambda: saturation([4], 8, 4, 0, ["unscaled", "scaled", "unscaled"]), "mechanisms",
     "'unscaled'"),
    (lambda: saturation([4, 16, 4], 8, 4, 0), "d_ks", "4"),
    (lambda: saturation([4], [8, 16, 8], 4, 0), "n", "8"),
    (lambda: variance([64, 64], 100, 0), "d_ks", "64"),
])
def test_repeated_list_entries_are_refused(call, param, value):
    with pytest.raises(ConfigError, match=rf"^{param} lists {value} more than once"):
        call()


# ---------------------------------------------------------------------------------------------
# Lists of n (the report's entropy-vs-n section asks for several n in one call)


def test_n_list_gives_one_row_per_mechanism_dk_and_n():
    rows = saturation([4, 16], [8, 32, 128], 20, seed=0)
    assert [(r["d_k"], r["n"], r["mechanism"]) for r in rows] == [
        (d, n, m) for d in (4, 16) for n in (8, 32, 128) for m in ("scaled", "unscaled")]
    for n in (8, 32, 128):  # a cell does not depend on which other n were requested
        assert [r for r in rows if r["n"] == n] == saturation([4, 16], n, 20, seed=0)


def test_entropy_grows_with_ln_n_for_scaled():
    rows = saturation([64], [16, 256, 4096], 300, seed=1, mechanisms="scaled")
    ent = [r["entropy_mean"] for r in rows]
    gaps = [math.log(r["n"]) - r["entropy_mean"] for r in rows]
    assert ent[0] < ent[1] < ent[2]
    # Unit-variance logits: the gap to ln n tends to sigma^2 / 2 = 0.5 as n grows.
    assert all(0.3 < g < 0.6 for g in gaps), gaps


# ---------------------------------------------------------------------------------------------
# Sizes: refused up front when they cannot fit, bounded memory otherwise, progress shown


@pytest.mark.parametrize("call, what", [
    (lambda: saturation([4], 100_000_000_000, 4, 0), "n=100000000000"),
    (lambda: saturation([4], [8, 10 ** 12], 4, 0), "n=1000000000000"),
    (lambda: saturation([2 ** 40], 256, 4, 0, ["qknorm"]), "d_k=1099511627776"),
    (lambda: saturation_direct(4, 10 ** 11, 4, 0), "n=100000000000"),
])
def test_requests_too_large_for_memory_are_refused_up_front(call, what):
    pattern = rf"{what}.* would need about [\d,.]+ GiB of memory"
    with pytest.raises(ConfigError, match=pattern) as err:
        call()
    assert "\n" not in str(err.value)


def test_memory_refusal_uses_the_machines_ram(monkeypatch):
    import attnscale.memory as memory
    monkeypatch.setattr(memory, "physical_memory", lambda: 2 ** 20)   # a 1 MiB machine
    with pytest.raises(ConfigError, match=r"50% of this machine's 0.0 GiB"):
        saturation([4], 8, 4, 0)
    monkeypatch.setattr(memory, "physical_memory", lambda: None)      # unknown: nothing refused
    assert len(saturation([4], 8, 4, 0)) == 2


def test_variance_memory_does_not_grow_with_pairs():
    """4M pairs (the samples, whole, would be 32 MiB of float64) in chunks: peak resident
    memory a fraction of that."""
    pairs = 4 * 2 ** 20
    peak = peak_mib(_SETUP, f"variance([16], {pairs}, seed=0)",
                    warm="variance([16], 1000, seed=0)")
    assert peak < pairs * 8 / 2 ** 20 / 4, f"peak {peak:.1f} MiB"


@pytest.mark.parametrize("call, total", [
    (lambda: variance([4, 16], 1000, 0, show_progress=True), 2000),
    (lambda: saturation([4, 16], [8, 32], 30, 0, ["scaled", "qknorm"], show_progress=True),
     2 * 2 * 2 * 30),
])
def test_progress_bar_counts_the_work_on_stderr(capsys, monkeypatch, call, total):
    import attnscale.measure.montecarlo as mc
    bars = []

    def recording(*args, **kwargs):
        bars.append(mc_progress(*args, **kwargs))
        return bars[-1]

    mc_progress = mc.progress
    monkeypatch.setattr(mc, "progress", recording)
    call()
    assert len(bars) == 1 and bars[0].total == total and bars[0].n == total
    assert f"0/{total}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The std interval respects the support


@pytest.mark.parametrize("pairs", [2, 3, 5, 10])
@pytest.mark.parametrize("d_k", [1, 4, 64])
def test_std_interval_stays_positive_for_tiny_samples(d_k, pairs):
    for seed in range(5):
        r, = variance([d_k], pairs, seed=seed)
        lo, hi = r["std_ci95"]
        assert 0.0 < lo < r["std"] < hi, r
        assert r["rel_error_ci95"][0] > -1.0


def test_std_interval_covers_the_truth_at_the_nominal_rate():
    """At 50 pairs the log-scale interval covers sqrt(d_k) about 95% of the time; a binomial
    band of 4 standard errors around 0.95 over 400 seeds."""
    d_k, seeds = 16, 400
    hits = 0
    for seed in range(seeds):
        lo, hi = variance([d_k], 50, seed=seed)[0]["std_ci95"]
        hits += lo <= 4.0 <= hi
    se = math.sqrt(0.95 * 0.05 / seeds)
    assert abs(hits / seeds - 0.95) <= BAND * se + 0.02, hits  # + the delta method's own bias
