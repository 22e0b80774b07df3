"""The gradient argument: the two paths against autograd, their limits, and init-reparam."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch.testing import assert_close

from attnscale.errors import ConfigError
from attnscale.measure.gradient import (
    GRADIENT_DV, gradient_path_sweep, gradient_paths, init_reparam_checks, one_hot_limit,
)
from attnscale.report.claims import CLAIMS_BY_ID
from attnscale.report.model import judge


def test_paths_equal_autograd_in_float64():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(4, 3, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 3, 10, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 3, 5, generator=gen, dtype=torch.float64)
    o = (torch.softmax(z, -1).unsqueeze(-2) @ v).squeeze(-2)  # (4, 3, 5)
    dz, dv = torch.autograd.grad(o, (z, v), g)
    paths = gradient_paths(z, v, g)
    assert_close(paths.routing, dz)
    assert_close(paths.value, dv)
    # The routing path is J a with the explicit Jacobian J = diag(p) - p pᵀ.
    p = paths.weights
    jac = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    a = (v @ g.unsqueeze(-1)).squeeze(-1)
    assert_close(paths.routing, (jac @ a.unsqueeze(-1)).squeeze(-1))


def test_one_hot_kills_routing_and_keeps_the_value_path():
    z = torch.tensor([0.0, 5e3, -1.0, 2.0], dtype=torch.float64)
    v = torch.randn(4, 3, dtype=torch.float64)
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    paths = gradient_paths(z, v, g)
    assert torch.equal(paths.routing, torch.zeros(4, dtype=torch.float64))  # exactly zero
    assert_close(paths.value[1], g)                                        # selected key gets g
    rows = one_hot_limit(d_k=64, n=32)
    assert rows[0]["max_weight"] < 0.5                    # the scaled temperature: diffuse
    saturated = [r["routing_norm"] for r in rows if r["max_weight"] > 0.9]
    assert len(saturated) >= 3
    assert all(b <= a for a, b in zip(saturated, saturated[1:]))  # shrinks once p saturates
    assert rows[-1]["routing_norm"] == 0.0 and rows[-1]["max_weight"] == 1.0
    assert abs(rows[-1]["value_over_g"] - 1.0) < 1e-12


def test_sweep_unscaled_routing_collapses_while_value_grows():
    rows = gradient_path_sweep(d_ks=(1, 1024), n=64, trials=60, seed=0, chunk=25)
    by = {(r["mechanism"], r["d_k"]): r for r in rows}
    # d_k = 1: 1/sqrt(d) = 1, the two mechanisms are the same computation.
    for key in ("routing_norm_mean", "value_norm_mean", "max_weight_mean"):
        assert by["scaled", 1][key] == by["unscaled", 1][key]
    s, u = by["scaled", 1024], by["unscaled", 1024]
    share_u = u["routing_norm_mean"] / u["value_norm_mean"]
    share_s = s["routing_norm_mean"] / s["value_norm_mean"]
    assert share_u < 0.25 < 0.5 < share_s
    assert u["value_norm_mean"] > 3 * s["value_norm_mean"]
    assert all(r["trials"] == 60 and r["routing_norm_se"] > 0 for r in rows)


def test_sweep_matches_sampling_every_coordinate():
    """The sweep's shortcut (|q| h for the logits, |g| h' for the a_i) against the essay's method:
    q, k, v and g drawn coordinatewise and split by gradient_paths."""
    d_k, n, trials = 64, 32, 3000
    rows = {r["mechanism"]: r for r in gradient_path_sweep(d_ks=(d_k,), n=n, trials=trials,
                                                            seed=4)}
    gen = torch.Generator().manual_seed(123)
    q = torch.randn(trials, 1, d_k, generator=gen)
    k = torch.randn(trials, n, d_k, generator=gen)
    v = torch.randn(trials, n, GRADIENT_DV, generator=gen)
    g = torch.randn(trials, GRADIENT_DV, generator=gen) / math.sqrt(GRADIENT_DV)
    dots = (q @ k.mT)[:, 0]                                                  # (T, n)
    for name, scale in (("scaled", 1 / math.sqrt(d_k)), ("unscaled", 1.0)):
        paths = gradient_paths(scale * dots, v, g)
        ref = {"max_weight": paths.weights.max(-1).values,
               "routing_norm": paths.routing.norm(dim=-1),
               "value_norm": paths.value.flatten(-2).norm(dim=-1)}
        for key, x in ref.items():
            row = rows[name]
            se = math.hypot(row[f"{key}_se"], float(x.std()) / math.sqrt(trials))
            assert abs(row[f"{key}_mean"] - float(x.mean())) <= 4.5 * se, (name, key)


def test_init_reparam_claims():
    rows = {r["check"]: r for r in init_reparam_checks(d_model=16, n_heads=2, n_tokens=6)}
    assert rows["step0"]["max_abs_diff"] < 1e-12          # identical at step 0
    assert rows["sgd"]["rel_diff"] < 1e-10                # SGD: lr <-> lr·√d_k on W_Q, W_K
    assert rows["sgd"]["scaled_qk_lr"] == rows["sgd"]["lr"] * math.sqrt(8)
    assert rows["adam"]["rel_diff"] > 0.1                 # Adam breaks that correspondence
    assert rows["adam-quarter"]["rel_diff"] < 1e-4        # ... and tracks d_k^(1/4) instead


def test_report_section_agrees_with_its_claims(tmp_path, monkeypatch):
    import attnscale.report.sections.gradient as section

    monkeypatch.setattr(section, "gradient_path_sweep",
                        partial(gradient_path_sweep, n=64, trials=40, chunk=40))
    monkeypatch.setattr(section, "init_reparam_checks", partial(init_reparam_checks, d_model=16))
    result = section.report_section(tmp_path, seed=0)
    assert (tmp_path / section.FIGURE).stat().st_size > 0
    assert {"gradient.routing.one_hot", "gradient.value.one_hot",
            "gradient.routing_share.unscaled.dk1024", "init_reparam.step0.max_abs_diff",
            "init_reparam.sgd.max_abs_diff", "init_reparam.adam.rel_diff"} == set(
                result.measurements)
    for claim_id, measurement in result.measurements.items():
        assert judge(CLAIMS_BY_ID[claim_id], measurement).agrees, claim_id
    assert {r["experiment"] for r in result.rows} == {"gradient_paths", "one_hot_limit",
                                                      "init_reparam"}


def test_no_experiment_touches_the_global_generator():
    state = torch.random.get_rng_state()
    init_reparam_checks(d_model=16, n_tokens=4, batch=2)
    gradient_path_sweep(d_ks=(4,), n=8, trials=4)
    one_hot_limit(d_k=8, n=4)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_single_mechanism_name_is_one_mechanism():
    rows = gradient_path_sweep(d_ks=(4,), mechanisms="unscaled", n=8, trials=4)
    assert [r["mechanism"] for r in rows] == ["unscaled"]


def test_rows_do_not_depend_on_other_requested_d_ks():
    alone = gradient_path_sweep(d_ks=(16,), n=8, trials=10, seed=3)
    among = gradient_path_sweep(d_ks=(4, 16), n=8, trials=10, seed=3)
    assert [r for r in among if r["d_k"] == 16] == alone
    assert init_reparam_checks(d_model=16, seed=1) == init_reparam_checks(d_model=16, seed=1)


@pytest.mark.parametrize("call, param", [
    (lambda: gradient_path_sweep(d_ks=(4, 4), n=8, trials=4), "d_ks"),
    (lambda: gradient_path_sweep(d_ks=(4,), mechanisms=("scaled", "scaled"), n=8, trials=4),
     "mechanisms"),
    (lambda: one_hot_limit(d_k=8, n=4, multipliers=(1.0, 4.0, 1.0)), "multipliers"),
])
def test_repeated_list_entries_are_refused(call, param):
    with pytest.raises(ConfigError, match=rf"^{param} lists .* more than once"):
        call()


@pytest.mark.parametrize("call, param", [
    (lambda: gradient_path_sweep(d_ks=(4,), mechanisms=("scaled", "scaeld"), n=8, trials=4),
     "mechanisms"),
    (lambda: gradient_path_sweep(d_ks=(4,), mechanisms=[], n=8, trials=4), "mechanisms"),
    (lambda: gradient_path_sweep(d_ks=(4,), n=8, trials=4, seed=-1), "seed"),
    (lambda: gradient_path_sweep(d_ks=(4,), n=10 ** 12, trials=4), "n="),
    (lambda: one_hot_limit(d_k=8, n=10 ** 12), "n="),
    (lambda: gradient_path_sweep(d_ks=(4,), n=8, trials=10 ** 14), "trials="),
])
def test_bad_arguments_are_one_line_config_errors(call, param):
    with pytest.raises(ConfigError) as err:
        call()
    assert param in str(err.value) and "\n" not in str(err.value)
