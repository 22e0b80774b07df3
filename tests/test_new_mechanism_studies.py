"""softpick, stick-breaking and mscale in the studies: the first-key weight the LM records (what
the attention-sink rate counts) against the materialised weights, the sink-rate claims, the
length study's stick-breaking and DeepSeek mscale claims, and the lm-length mscale trial."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import attnscale
from attnscale.attention import MultiHeadAttention, attention_reference
from attnscale.experiments import registry
from attnscale.experiments.lm.study import SINK_THRESHOLD, sink_rate
from attnscale.measure.monitor.blocks import first_key_weight
from attnscale.pipeline import observe

SRC = Path(attnscale.__file__).parent


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSCALE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", ["scaled", "sink", "sigmoid", "softpick", "stick-breaking",
                                  "forgetting", "selective", "differential"])
def test_first_key_weight_is_the_mean_weight_on_key_0(name):
    """From the observed q and k, blockwise, under the mechanism's normaliser (differential's
    net weight p1 − λ p2) and with its logit bias: the traced weights' column 0, averaged over
    the (batch, query) rows that attend key 0."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(24, 3, name, dtype=torch.float64)
    if name == "sink":
        with torch.no_grad():
            mha.mechanism.b.copy_(torch.tensor([-1.0, 0.5, 2.0]))
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    mask = torch.rand(2, 1, 9, 9) > 0.3
    mask[0, 0, :, 0] = False                       # batch 0: no query attends the first key
    seen = []
    with observe(seen.append):
        mha(x, mask=mask, causal=True)
    (obs,) = seen
    total, rows = first_key_weight(obs, block=4)
    q, k = mha._split(mha.w_q(x)), mha._split(mha.w_k(x))
    log_forget = mha.mechanism.forget_gates(x) if name == "forgetting" else None
    trace = attention_reference(q, k, q, mha.mechanism, mask=mask, causal=True,
                                log_forget=log_forget)
    keep = (mask & torch.ones(9, 9, dtype=torch.bool).tril())[..., 0].expand(2, 3, 9)
    want = torch.where(keep, trace.weights[..., 0], 0.0).sum((0, 2))
    assert_close(rows, keep.double().sum((0, 2)))
    assert_close(total, want)


def test_sink_rate_counts_heads_above_the_threshold():
    assert SINK_THRESHOLD == 0.3                   # Gu et al. 2024's ε
    record = {"first_key_weight": [[0.31, 0.1], [0.29, 0.9]]}
    assert sink_rate(record) == 0.5
    assert sink_rate({"first_key_weight": None}) is None and sink_rate({}) is None


def test_lm_records_first_key_weights_per_layer_and_head(text_dir):
    from attnscale.experiments.lm.train import train_lm
    r = train_lm(mechanism="softpick", d_model=16, n_layers=2, n_heads=2, seq_len=16,
                 batch_size=4, steps=3, eval_windows=3, monitor_every=1, data=str(text_dir))
    weights = r["first_key_weight"]
    assert len(weights) == 2 and all(len(layer) == 2 for layer in weights)
    assert all(0.0 <= w <= 1.0 for layer in weights for w in layer)


def _sink_record(variant, seed, weights):
    return {"config": {"mechanism": variant, "options": {}, "seed": seed, "d_model": 128,
                       "lr": 1e-2, "steps": 2000},
            "first_key_weight": weights, "final_val_loss": 2.0}


@pytest.mark.parametrize("scaled, softpick, verdicts", [
    ([[0.5, 0.1]], [[0.0, 0.1]], ("agrees", "agrees")),
    ([[0.5, 0.4]], [[0.35, 0.1]], ("agrees", "differs: some head sinks")),
    ([[0.1, 0.1]], [[0.0, 0.1]], ("inconclusive: scaled has no sinks here", "agrees")),
])
def test_softpick_sink_claims(scaled, softpick, verdicts):
    from attnscale.study.lm import sink_claims, sink_rows
    records = [_sink_record("scaled", s, scaled) for s in (0, 1)]
    records += [_sink_record("softpick", s, softpick) for s in (0, 1)]
    lower, zero = sink_claims(records)
    assert lower["verdict"].startswith(verdicts[0]) and zero["verdict"] == verdicts[1]
    rows = {r["mechanism"]: r for r in sink_rows(records)}
    assert rows["scaled"]["sink_rate"]["mean"] == sum(w > 0.3 for w in scaled[0]) / 2
    assert sink_claims(records[:2]) == []          # no softpick runs: no claim


def _lm_record(mechanism, seed, loss_at, mscale=None):
    result = {"lengths": [128, 1024], "loss_at_length": loss_at}
    if mscale is not None:
        result["mscale"] = mscale
    return {"config": {"mechanism": mechanism, "seed": seed, "seq_len": 128},
            "result": result}


def test_stick_breaking_claims_against_scaled():
    from attnscale.study.length import claims
    lm = [_lm_record("scaled", s, [2.0, 3.0 + 0.1 * s]) for s in (0, 1)]
    lm += [_lm_record("stick-breaking", s, [2.1, 2.5 + 0.1 * s]) for s in (0, 1)]
    recall = [{"config": {"mechanism": m, "seed": s, "pairs": 16},
               "result": {"lengths": [16, 512], "accuracy": [1.0, a], "entropy": [1.0, 2.0],
                          "max_weight": [0.5, 0.4]}}
              for m, acc in (("scaled", 0.3), ("stick-breaking", 0.9)) for s, a in
              enumerate((acc, acc + 0.05))]
    found = {c["quantity"]: c for c in claims(recall, lm) if "stick-breaking" in c["quantity"]}
    assert len(found) == 2 and all(c["verdict"] == "agrees" for c in found.values())
    assert any("512 pairs" in q for q in found) and any("context 1024" in q for q in found)


def test_mscale_claims_compare_deepseek_v2_with_yarn_on_one_model():
    from attnscale.study.length import claims, mscale_rows

    def rows(v2, yarn):
        return [{"factor": 2, "length": 256, "mscale_all_dim": 0.707, "m": 1.049, "loss": v2},
                {"factor": 2, "length": 256, "mscale_all_dim": 1.0, "m": 1.069, "loss": yarn}]

    lm = [_lm_record("mscale", 0, [2.0, 3.0], rows(2.50, 2.52)),
          _lm_record("mscale", 1, [2.0, 3.0], rows(2.40, 2.41))]
    (row,) = mscale_rows(lm)
    assert_close(row["difference"]["mean"], -0.015)
    (claim,) = [c for c in claims([], lm) if "DeepSeek-V2" in c["quantity"]]
    assert claim["verdict"] == "agrees" and claim["ci"] == pytest.approx([-0.02, -0.01])
    lm[1] = _lm_record("mscale", 1, [2.0, 3.0], rows(2.40, 2.39))
    (claim,) = [c for c in claims([], lm) if "DeepSeek-V2" in c["quantity"]]
    assert claim["verdict"].startswith("inconclusive")
    # Without mscale runs there is no DeepSeek claim (the shipped pages redraw unchanged).
    assert not [c for c in claims([], [_lm_record("scaled", 0, [2.0, 3.0])])
                if "mscale" in c["quantity"]]


def test_lm_length_mscale_trial_is_the_scaled_model_under_deepseeks_rule(text_dir):
    exp = registry.get("lm-length")
    tiny = {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 16, "batch_size": 4,
            "steps": 4, "eval_windows": 3, "lengths": "16,32", "yarn_factors": "2,4",
            "data": str(text_dir)}
    scaled = exp.fn(**exp.config({"mechanism": "scaled", **tiny}))
    ms = exp.fn(**exp.config({"mechanism": "mscale", **tiny}))
    # factor 1 leaves scaled's logits alone: the same trained model, bit for bit
    assert ms["loss_at_length"] == scaled["loss_at_length"]
    assert "yarn" not in ms and [(e["factor"], e["mscale_all_dim"]) for e in ms["mscale"]] == [
        (2, 0.707), (2, 1.0), (4, 0.707), (4, 1.0)]
    for e in ms["mscale"]:
        assert e["m"] == pytest.approx(0.1 * e["mscale_all_dim"] * math.log(e["factor"]) + 1)
        if e["mscale_all_dim"] == 1.0:  # YaRN's own rule: the scaled sweep's curve there
            (y,) = [y for y in scaled["yarn"] if y["factor"] == e["factor"]]
            near = min(range(len(y["m"])), key=lambda i: abs(y["m"][i] - e["m"]))
            assert abs(y["m"][near] - e["m"]) < 0.03
            assert e["loss"] == pytest.approx(y["loss"][near], abs=0.05)
    sb = exp.fn(**exp.config({"mechanism": "stick-breaking", **tiny}))
    assert "yarn" not in sb and "mscale" not in sb and len(sb["loss_by_position"]) == 32
