"""The length study (``attnscale study length``): the recall-length and lm-length trials, YaRN's
NTK-by-parts frequencies, evaluation by position, the temperature fit, and ``study length``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import attnscale
from attnscale.errors import ConfigError
from attnscale.experiments.length import lm as lm_length
from attnscale.experiments.lm.data import eval_windows, load_corpus
from attnscale.experiments.lm.model import LMConfig, build_lm, rope_frequencies
from attnscale.experiments.lm.train import loss_by_position
from attnscale.measure.monitor import monitor
from attnscale.report.include import load_study
from attnscale.study import STUDIES, Trials
from attnscale.experiments import registry

SRC = Path(attnscale.__file__).parent


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSCALE_CACHE", str(tmp_path / "cache"))


TINY_RECALL = {"d_k": 8, "d_model": 8, "steps": 6, "batch_size": 8, "n_keys": 64,
               "eval_size": 40, "lengths": "16,32,64"}


def tiny_lm(text_dir: Path) -> dict:
    return {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 16, "batch_size": 4,
            "steps": 4, "eval_windows": 3, "lengths": "16,32,64", "yarn_factors": "2,4",
            "data": str(text_dir)}


# --- recall-length --------------------------------------------------------------------------------

@pytest.mark.parametrize("mechanism", ["scaled", "ssmax", "llama4-temp", "qknorm"])
def test_recall_length_trial(mechanism):
    exp = registry.get("recall-length")
    config = exp.config({"mechanism": mechanism, **TINY_RECALL})
    exp.check(config)
    out = exp.fn(**config)
    assert out["lengths"] == [16, 32, 64]
    for key in ("accuracy", "entropy", "max_weight"):
        assert len(out[key]) == 3
    for n, acc, ent in zip(out["lengths"], out["accuracy"], out["entropy"]):
        assert 0.0 <= acc <= 1.0
        assert 0.0 <= ent <= math.log(n) + 1e-9
    # Scored at the trained pair count on the trainer's own held-out set: the trainer's number.
    assert out["accuracy"][0] == out["train_accuracy"]
    assert out["options"] == ({"floor_scale": 16.0} if mechanism == "llama4-temp" else {})


def test_recall_length_defaults_hold_512_distinct_keys():
    exp = registry.get("recall-length")
    config = exp.config({})
    assert config["n_keys"] >= 512 and config["pairs"] == 16
    assert config["lengths"] == "16,32,64,128,256,512"
    exp.check(config)


@pytest.mark.parametrize("bad, pattern", [
    ({"lengths": "16,128", "n_keys": 64}, "n_keys"),
    ({"lengths": "16,16"}, "lengths"),
    ({"mechanism": "scaled", "floor_scale": 8.0}, "floor_scale"),
    ({"mechanism": "nope"}, "mechanism"),
])
def test_recall_length_bad_config(bad, pattern):
    exp = registry.get("recall-length")
    with pytest.raises(ConfigError, match=pattern):
        exp.check(exp.config(bad))


# --- YaRN, evaluation by position, the fit --------------------------------------------------------

def test_yarn_frequencies_match_the_paper_on_hand_values():
    # L = 128: r = L θ / 2π.  θ chosen so r = 0.5, 1, 16.5, 32, 40: γ = 0, 0, 0.5, 1, 1.
    L, s = 128, 4.0
    r = torch.tensor([0.5, 1.0, 16.5, 32.0, 40.0], dtype=torch.float64)
    theta = 2 * math.pi * r / L
    got = lm_length.yarn_frequencies(theta, s, L)
    t = theta.tolist()
    # h = (1 - γ) θ / s + γ θ, by hand:
    expected = torch.tensor([t[0] / 4, t[1] / 4, 0.5 * t[2] / 4 + 0.5 * t[2], t[3], t[4]],
                            dtype=torch.float64)
    assert_close(got, expected)
    assert_close(got[2], torch.tensor(0.5 * 2 * math.pi * 16.5 / 128 * 1.25, dtype=torch.float64))
    # s = 1 changes nothing; every frequency moves by at most the factor s.
    base = rope_frequencies(32)
    assert_close(lm_length.yarn_frequencies(base, 1.0, L), base)
    scaled = lm_length.yarn_frequencies(base, 8.0, L)
    assert bool(((scaled <= base) & (scaled >= base / 8 - 1e-15)).all())


def test_yarn_bad_inputs():
    with pytest.raises(ConfigError, match="factor"):
        lm_length.yarn_frequencies(rope_frequencies(8), 0.0, 128)
    with pytest.raises(ConfigError, match="beta"):
        lm_length.yarn_frequencies(rope_frequencies(8), 2.0, 128, alpha=4.0, beta=2.0)


@pytest.fixture
def small_model(text_dir):
    model = build_lm(LMConfig(d_model=16, n_heads=2, n_layers=2, max_seq_len=16), seed=0)
    corpus = load_corpus(str(text_dir))
    return model, eval_windows(corpus.val, 3, 48)


def test_loss_and_entropy_by_position(small_model):
    model, windows = small_model
    base = rope_frequencies(model.config.d_head)
    model.set_rope(base, 48)
    plain = loss_by_position(model, windows, batch_size=2)
    assert plain.shape == (48,)
    # s = 1 interpolation and multiplier 1 leave the model as it was.
    model.set_rope(lm_length.yarn_frequencies(base, 1.0, 16), 48)
    with lm_length.tempered(model, 1.0):
        assert_close(loss_by_position(model, windows, batch_size=2), plain)
    with lm_length.tempered(model, 1.3):
        hotter = loss_by_position(model, windows, batch_size=2)
    assert not torch.equal(hotter, plain)
    assert all(type(b.attn.mechanism).__name__ != "Tempered" for b in model.blocks)
    # Entropy by position: (layers, N), 0 at the first query, at most ln(i + 1) ...
    ent = lm_length.entropy_by_position(model, windows[0], batch_size=2)
    assert ent.shape == (2, 48)
    assert_close(ent[:, 0], torch.zeros(2, dtype=torch.float64))
    assert bool((ent <= torch.log(torch.arange(1, 49, dtype=torch.float64)) + 1e-6).all())
    # ... and its mean over positions is the monitor's mean entropy per layer.
    with torch.no_grad(), monitor(model) as mon:
        model(windows[0])
    by_layer = {}
    for rec in mon.records:
        by_layer.setdefault(rec["layer"], []).append(rec["entropy_mean"])
    expected = torch.tensor([sum(v) / len(v) for _, v in sorted(by_layer.items())],
                            dtype=torch.float64)
    assert_close(ent.mean(-1), expected, rtol=1e-5, atol=1e-6)


def test_fit_minimum_on_synthetic_curves():
    grid = lm_length.M_GRID
    fit = lm_length.fit_minimum(grid, [(m - 1.13) ** 2 + 2.0 for m in grid])
    assert fit["edge"] is False
    assert_close(fit["x"], 1.13)
    assert_close(fit["y"], 2.0, atol=1e-9, rtol=0)
    edge = lm_length.fit_minimum(grid, list(grid))
    assert edge == {"x": grid[0], "y": grid[0], "edge": True}
    gappy = [math.nan] + [(m - 1.2) ** 2 for m in grid[1:]]
    assert_close(lm_length.fit_minimum(grid, gappy)["x"], 1.2)
    assert lm_length.fit_minimum([1.0], [math.nan])["x"] is None


def test_lm_length_trial(text_dir):
    exp = registry.get("lm-length")
    out = exp.fn(**exp.config({"mechanism": "scaled", **tiny_lm(text_dir)}))
    assert out["lengths"] == [16, 32, 64]
    assert len(out["loss_by_position"]) == 64 and len(out["loss_at_length"]) == 3
    assert_close(out["loss_at_length"][-1], sum(out["loss_by_position"]) / 64)
    assert len(out["entropy_by_position"]) == 2
    assert [y["factor"] for y in out["yarn"]] == [2, 4]
    for y in out["yarn"]:
        assert y["length"] == 16 * y["factor"] and len(y["loss"]) == len(lm_length.M_GRID)
        assert y["fit"]["y"] <= min(y["loss"]) + 1e-9
    other = exp.fn(**exp.config({"mechanism": "llama4-temp", **tiny_lm(text_dir)}))
    assert "yarn" not in other and other["options"] == {"floor_scale": 16.0}


# --- study length ---------------------------------------------------------------------------------

@pytest.fixture
def tiny_study(monkeypatch, text_dir):
    quick = {"recall-length": Trials("recall-length", {"mechanism": ["scaled", "ssmax"],
                                                       "seed": [0, 1]}, TINY_RECALL),
             "lm-length": Trials("lm-length", {"mechanism": ["scaled", "ssmax"], "seed": [0]},
                                 tiny_lm(text_dir))}
    monkeypatch.setitem(STUDIES, "length", dataclasses.replace(STUDIES["length"], quick=quick))


def test_study_length_end_to_end(cli, tmp_path, tiny_study):
    out = tmp_path / "length"
    code, stdout, err = cli("study", "length", "--out", str(out), "--quick", "--workers", "1",
                            "--json")
    assert code == 0, err
    claims = json.loads(stdout)["claims"]
    assert {c["quantity"].split(":")[0] for c in claims} >= {
        "recall accuracy at 64 pairs, trained at 16"}
    assert sum("YaRN" in c["quantity"] for c in claims) == 2
    assert sum("slope" in c["quantity"] for c in claims) == 1
    found = load_study(out)  # the --include contract
    assert set(found.figures) == {"length_recall.png", "length_lm_loss.png",
                                  "length_lm_entropy.png", "length_yarn.png"}
    assert len(found.claims) == len(claims)
    summary = json.loads((out / "length_study.json").read_text())
    assert len(summary["recall"]) == 2 * 3 and summary["recall"][0]["accuracy"]["n"] == 2
    # Running again resumes (nothing left to run); --from redraws the same claims.
    before = (out / "recall-length" / "results.jsonl").read_text()
    assert cli("study", "length", "--resume", str(out), "--workers", "1")[0] == 0
    assert (out / "recall-length" / "results.jsonl").read_text() == before
    code, stdout, _ = cli("study", "length", "--from", str(out), "--json")
    assert code == 0 and json.loads(stdout)["claims"] == claims
    # The full settings into the quick study's folder are refused.
    code, _, err = cli("study", "length", "--out", str(out))
    assert code == 2 and "quick" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, pattern", [
    ((), "--out"),
    (("--out", "{tmp}/a", "--from", "{tmp}/a"), "--out"),
    (("--from", "{tmp}/missing"), "--from"),
    (("--from", ""), "--from"),
    (("--resume", "{tmp}/b"), "--resume"),
    (("--out", "{tmp}/b", "--resume", "{tmp}/b"), "--out"),
    (("--resume", "{tmp}/b", "--quick"), "--quick"),
    (("--out", "{tmp}/c", "--workers", "0"), "workers"),
    (("--from", "{tmp}/d", "--quick"), "--from"),
])
def test_study_length_bad_inputs(cli, tmp_path, argv, pattern):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = cli("study", "length", *argv)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert pattern in err, err
    assert not list(tmp_path.iterdir())


def _recall_record(mechanism: str, seed: int, accuracy: list) -> dict:
    return {"config": {"mechanism": mechanism, "seed": seed, "pairs": 16},
            "result": {"lengths": [16, 512], "accuracy": accuracy, "entropy": [1.0, 2.0],
                       "max_weight": [0.5, 0.4]}}


@pytest.mark.parametrize("ssmax_at_512, verdict", [
    ((0.9, 0.8), "agrees"),                                  # above scaled's [0.5, 0.6]
    ((0.55, 0.7), "inconclusive: the seed ranges overlap"),
    ((0.2, 0.3), "differs: the opposite order"),
    ((None, None), None),                                    # every seed diverged: no claim
])
def test_ssmax_claim_verdicts(ssmax_at_512, verdict):
    from attnscale.study.length import claims
    records = [_recall_record("scaled", s, [0.9, a]) for s, a in enumerate((0.5, 0.6))]
    records += [_recall_record("ssmax", s, [0.9, a]) for s, a in enumerate(ssmax_at_512)]
    found = [c for c in claims(records, []) if "ssmax" in c["quantity"]]
    if verdict is None:
        assert found == []
        return
    (claim,) = found
    assert claim["verdict"] == verdict and claim["agrees"] == (verdict == "agrees")
    assert claim["ci"] == [min(ssmax_at_512), max(ssmax_at_512)]
