"""Saturation at init for every registered mechanism: rotated-frame sampling vs direct sampling."""

from __future__ import annotations

import math

import pytest

from attnscale.errors import ConfigError
from attnscale.mechanisms import MECHANISMS
from attnscale.measure.montecarlo import saturation, saturation_direct

AT_INIT = [name for name, cls in MECHANISMS.items() if cls.defined_at_init]
IN_WEIGHTS = [name for name, cls in MECHANISMS.items() if not cls.defined_at_init]
STATS = ("max_weight", "entropy", "jacobian_fro", "logit_std")


@pytest.mark.parametrize("d_k", [8, 64])
@pytest.mark.parametrize("mechanism", AT_INIT)
def test_sampled_statistics_match_direct_sampling(mechanism, d_k):
    # Two independent estimates of the same means: their gap has sd sqrt(se1^2 + se2^2); with
    # 4 mechanisms x 2 d_k x 4 statistics per run a 4.5-sd band keeps false alarms below 1e-3.
    (row,) = saturation([d_k], 128, 400, 0, (mechanism,))
    ref = saturation_direct(d_k, 128, 400, 1, mechanism)
    for stat in STATS:
        se = math.hypot(row[f"{stat}_se"], ref[f"{stat}_se"])
        gap = abs(row[f"{stat}_mean"] - ref[f"{stat}_mean"])
        assert gap <= 4.5 * se + 1e-6, (stat, row[f"{stat}_mean"], ref[f"{stat}_mean"], se)


def test_every_rule_of_the_raw_dot_product_takes_the_chi_square_shortcut():
    # cap(scale q.k + offset) under any normaliser but the differential one is a function of the
    # raw dot product, which the shortcut samples exactly; a rule that transforms q and k, or
    # reads the whole row, needs the vectors themselves.
    methods = {r["mechanism"]: r["method"] for r in saturation([8], 16, 4, 0, AT_INIT)}
    for name, method in methods.items():
        cls = MECHANISMS[name]
        raw = cls.bilinear and cls.per_key and cls.logit_bias is None
        assert method == ("chi2-shortcut" if raw else "rotation-frame" if cls.rotation_invariant
                          else "direct"), (name, method)
    assert {"softcap", "sigmoid", "sink", "ssmax", "learned-temp"} <= {
        name for name, method in methods.items() if method == "chi2-shortcut"}


@pytest.mark.parametrize("mechanism", AT_INIT)
def test_rows_are_valid_and_seeded(mechanism):
    rows = saturation([4, 16], 32, 10, 3, (mechanism,))
    assert [r["d_k"] for r in rows] == [4, 16]
    for r in rows:
        assert r["mechanism"] == mechanism and r["n"] == 32 and r["trials"] == 10
        assert 1 / 32 - 1e-6 <= r["max_weight_mean"] <= 1.0
        assert 0.0 <= r["entropy_mean"] <= math.log(32) + 1e-6
    assert rows == saturation([4, 16], 32, 10, 3, (mechanism,))


@pytest.mark.parametrize("mechanism", IN_WEIGHTS)
def test_mechanisms_living_in_the_weights_are_refused(mechanism):
    with pytest.raises(ConfigError, match="no temperature at init"):
        saturation([4], 8, 4, 0, (mechanism,))


def test_learned_temp_equals_scaled_at_init_and_mup_is_colder():
    rows = {r["mechanism"]: r for r in saturation([64], 256, 200, 0, ("learned-temp", "mup"))}
    scaled = saturation([64], 256, 200, 0, ("scaled",))[0]
    # Independent samples: compare within a band from their standard errors.
    se = math.hypot(rows["learned-temp"]["entropy_se"], scaled["entropy_se"])
    assert abs(rows["learned-temp"]["entropy_mean"] - scaled["entropy_mean"]) <= 4.5 * se
    # muP's 1/d is sqrt(d) = 8 times colder than 1/sqrt(d): entropy closer to ln n.
    assert rows["mup"]["entropy_mean"] > scaled["entropy_mean"] + 0.3
