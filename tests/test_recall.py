"""The associative-recall study: task invariants, fast == naive model, determinism, curve metrics."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from attnscale.errors import ConfigError
from attnscale.mechanisms import MECHANISMS
from attnscale.experiments.recall import RecallConfig, compare, train, train_runs
from attnscale.experiments.recall import metrics
from attnscale.experiments.recall.experiments import grad_decomposition, init_reparam_sgd
from attnscale.experiments.recall.model import BatchIndex, RecallNet, StackedRecall
from attnscale.experiments.recall.task import CHUNK_STEPS, eval_set, sample, train_chunk
from attnscale.experiments.recall.trainer import RunResult, stack_batches

# A small model that still exercises every shape (distinct sizes catch transposed axes).
TINY = RecallConfig(d_k=8, d_model=12, pairs=5, n_keys=7, n_values=6, steps=6, batch_size=4,
                    eval_size=20, log_every=2)


# ---------------------------------------------------------------------------------------------
# Task


def test_sample_invariants():
    batch = sample(np.random.default_rng(0), 500, pairs=16, n_keys=32, n_values=32)
    keys, values = batch.keys, batch.values
    assert keys.shape == values.shape == (500, 16) and batch.query.shape == (500,)
    assert all(len(set(row.tolist())) == 16 for row in keys)          # no duplicate keys
    assert keys.min() >= 0 and keys.max() < 32 and values.min() >= 0 and values.max() < 32
    match = keys == batch.query[:, None]                                # (500, 16)
    assert (match.sum(1) == 1).all()                                    # query is exactly one key
    assert torch.equal(values[match], batch.target)                     # target is its value


def test_stream_is_deterministic_and_eval_is_separate():
    a, b = train_chunk(TINY, 1), train_chunk(TINY, 1)
    assert a.keys.shape == (CHUNK_STEPS, TINY.batch_size, TINY.pairs)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.target, b.target)
    assert not torch.equal(train_chunk(TINY, 0).keys, a.keys)
    ev = eval_set(replace(TINY, eval_size=CHUNK_STEPS * TINY.batch_size))
    assert not torch.equal(ev.keys, train_chunk(TINY, 0).keys.flatten(0, 1))
    assert not torch.equal(train_chunk(replace(TINY, seed=1), 0).keys, train_chunk(TINY, 0).keys)


# ---------------------------------------------------------------------------------------------
# Fast model == straightforward model


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of a module's parameters by name (those that received one)."""
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _check_against_naive(configs: list[RecallConfig], force_pair_table: bool = False,
                         batch_keys: bool = False) -> None:
    """Loss, logits and every gradient of the stacked table-projected model equal the
    straightforward per-token model's, in float64."""
    nets = [RecallNet(c).double() for c in configs]
    naive = copy.deepcopy(nets)   # sigma-reparam's power iteration state advances per forward
    model = StackedRecall(nets)
    if force_pair_table or batch_keys:
        model.bilinear = (False,) * len(nets)
        model.pair_table = not batch_keys
    batches = [train_chunk(c, 0)[0] for c in configs]                   # (B,) each
    out = model(BatchIndex.build(stack_batches(batches), TINY.n_keys, TINY.n_values))
    out.loss.sum().backward()
    for m, (net, batch) in enumerate(zip(naive, batches)):
        ref = net(batch)
        ref.loss.backward()
        assert_close(out.loss[m], ref.loss)
        assert_close(out.z[m], ref.z)
        assert_close(out.logits[m], ref.logits)
        raw = (lambda lin: lin.parametrizations.weight.original
               if hasattr(lin, "parametrizations") else lin.weight)
        assert_close(model.embed.grad[m], net.embed.weight.grad)
        assert_close(model.w_q_t.grad[m], raw(net.w_q).grad.mT)
        assert_close(model.w_k_t.grad[m], raw(net.w_k).grad.mT)
        assert_close(model.w_v_t.grad[m], net.w_v.weight.grad.mT)
        assert_close(model.readout_t.grad[m], net.readout.weight.grad.mT)
        ours, ref_mech = _grads(model.mechanisms[m]), _grads(net.mechanism)
        assert ours.keys() == ref_mech.keys()
        for name, g in ref_mech.items():
            assert_close(ours[name], g)


# Every mechanism takes the pair-table path and the batch's own keys (the pair table larger than
# the batch); bilinear ones (a scale on qᵀk) also the score table.
PATHS = [(m, "pair-table") for m in MECHANISMS] + [(m, "batch-keys") for m in MECHANISMS] + [
    (m, "score-table") for m in MECHANISMS if RecallNet(replace(TINY, mechanism=m)).bilinear]


@pytest.mark.parametrize(("mechanism", "path"), PATHS)
def test_fast_model_equals_naive(mechanism, path):
    """Every mechanism, two seeds in one stacked model, on each path it can take."""
    configs = [replace(TINY, mechanism=mechanism, seed=s) for s in (0, 1)]
    _check_against_naive(configs, force_pair_table=path == "pair-table",
                         batch_keys=path == "batch-keys")


def test_fast_model_equals_naive_for_a_mixed_group():
    """Score-table and pair-table mechanisms stacked together."""
    _check_against_naive([replace(TINY, mechanism=m, seed=s) for m, s in
                          (("qknorm", 0), ("scaled", 1), ("cosine", 2), ("sigma-reparam", 0))])


def test_per_key_path_is_chosen_by_the_size_of_the_pair_table(monkeypatch):
    """The pair table while it is no larger than the batch's pairs, else the batch's keys."""
    from attnscale.experiments.recall import model as recall_model
    calls = []
    for name in ("_pair_logits", "_row_logits"):
        real = getattr(recall_model, name)
        monkeypatch.setattr(recall_model, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name)
                            or _real(*a, **k))
    for config, want in ((replace(TINY, mechanism="qknorm", batch_size=9), "_pair_logits"),
                         (replace(TINY, mechanism="qknorm", batch_size=8), "_row_logits")):
        # 7 keys x 6 values = 42 pairs: at most 9 x 5 = 45 pairs in the batch, at least 8 x 5
        calls.clear()
        model = StackedRecall([RecallNet(config)])
        batch = train_chunk(config, 0)[0]
        model(BatchIndex.build(stack_batches([batch]), config.n_keys, config.n_values))
        assert calls == [want]


def test_init_is_shared_across_mechanisms_and_reparam_matches_scaled():
    scaled = RecallNet(replace(TINY, mechanism="scaled"))
    unscaled = RecallNet(replace(TINY, mechanism="unscaled"))
    reparam = RecallNet(replace(TINY, mechanism="init-reparam"))
    assert torch.equal(scaled.w_q.weight, unscaled.w_q.weight)
    assert torch.equal(scaled.embed.weight, reparam.embed.weight)
    batch = train_chunk(TINY, 0)[0]
    assert_close(reparam(batch).z, scaled(batch).z)         # identical logits at step 0
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    RecallNet(replace(TINY, mechanism="sigma-reparam"))
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched


# ---------------------------------------------------------------------------------------------
# Determinism


def _curve_bytes(result) -> bytes:
    return np.asarray(result.loss, dtype=np.float32).tobytes()


def test_same_seed_same_curve_and_prefix_property():
    a = train(TINY, mechanism="qknorm")
    b = train(TINY, mechanism="qknorm")
    assert _curve_bytes(a) == _curve_bytes(b)
    assert a.eval_accuracy == b.eval_accuracy and a.trace == b.trace
    longer = train(TINY, mechanism="qknorm", steps=TINY.steps + 3)
    assert longer.loss[:TINY.steps] == a.loss                # step t sees the same batch
    assert train(TINY, mechanism="qknorm", seed=1).loss != a.loss


def test_same_curve_across_processes():
    code = ("import sys, numpy as np; from attnscale.experiments.recall import train, RecallConfig;"
            "r = train(RecallConfig(d_k=8, d_model=12, pairs=5, n_keys=7, n_values=6, steps=6,"
            " batch_size=4, eval_size=20, log_every=2), mechanism='unscaled');"
            "sys.stdout.write(np.asarray(r.loss, dtype=np.float32).tobytes().hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert bytes.fromhex(out.stdout) == _curve_bytes(train(TINY, mechanism="unscaled"))


def test_dk1_scaled_equals_unscaled():
    """"At d_k = 1 the two variants are literally identical": the same curves (up to the rounding
    of the two slots of one batched matmul)."""
    scaled, unscaled = compare(("scaled", "unscaled"), replace(TINY, d_k=1))
    assert_close(torch.tensor(unscaled.loss), torch.tensor(scaled.loss), rtol=1e-6, atol=0.0)
    assert unscaled.grad_wq_norm_step0 == pytest.approx(scaled.grad_wq_norm_step0, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Gradient decomposition and init-reparam


def test_grad_decomposition_and_reparam_gradient_scale():
    cfg = replace(TINY, d_k=16, steps=1)
    scaled, unscaled, reparam = compare(("scaled", "unscaled", "init-reparam"), cfg)
    d = grad_decomposition(scaled, unscaled)
    assert d["sqrt_d_k"] == 4.0
    assert d["ratio"] == pytest.approx(d["sqrt_d_k"] * d["saturation"], rel=1e-12)
    assert 0 < d["saturation"] and 0 < d["logit_grad_ratio"]
    # init-reparam: W' = d^-1/4 W computes the same logits, so dL/dW' = d^1/4 dL/dW exactly.
    assert reparam.loss[0] == pytest.approx(scaled.loss[0], rel=1e-6)
    assert reparam.grad_wq_norm_step0 == pytest.approx(2.0 * scaled.grad_wq_norm_step0, rel=1e-5)


def test_init_reparam_tracks_scaled_under_sgd():
    out = init_reparam_sgd(replace(TINY, d_k=16, steps=20), lr=0.1)
    assert out["tracking_max_rel_gap"] < 1e-4
    reparam, boosted, plain = out["runs"]
    assert_close(torch.tensor(reparam.loss), torch.tensor(boosted.loss), rtol=1e-4, atol=0.0)
    assert plain.loss != reparam.loss


# ---------------------------------------------------------------------------------------------
# Curve metrics on synthetic curves


def test_ema_and_milestones():
    assert metrics.ema([4.0, 4.0, 4.0]).tolist() == [4.0, 4.0, 4.0]
    s = metrics.ema([2.0, 0.0], decay=0.75)
    assert s.tolist() == [2.0, 1.5]
    curve = [3.0, 2.0, 1.0, 0.99, 0.5, 0.09]
    assert metrics.first_below(curve, 1.0) == 3          # strictly below
    assert metrics.first_below(curve, 0.1) == 5
    assert metrics.first_below(curve, 0.01) is None


def _staircase() -> np.ndarray:
    """Fast descent, a stall at 0.3 over steps 500-800, fast descent, then a slow tail."""
    t = np.arange(1500, dtype=np.float64)
    log_s = np.where(t < 500, np.log(3.0) + (np.log(0.3) - np.log(3.0)) * t / 500, np.log(0.3))
    log_s = np.where(t >= 800, np.log(0.3) + (np.log(0.01) - np.log(0.3)) * (t - 800) / 200,
                     log_s)
    log_s = np.where(t >= 1000, np.log(0.01) - 0.0005 * (t - 1000), log_s)
    return np.exp(log_s)


def test_plateau_found_with_its_span_and_level():
    found = metrics.plateaus(_staircase())
    assert len(found) == 1
    p = found[0]
    assert p["level"] == pytest.approx(0.3, rel=0.01)
    assert abs(p["start"] - 500) <= metrics.PLATEAU_WINDOW and abs(p["end"] - 800) <= 10


def test_no_plateau_on_steady_descent_or_convergence_tail():
    t = np.arange(1500)
    assert metrics.plateaus(3.0 * np.exp(-t / 150)) == []          # steady exponential descent
    tail = 0.01 * np.exp(-t / 2000)                                   # slow tail: never escapes
    assert metrics.plateaus(tail) == []
    short = _staircase().copy()
    short[500:800] = np.exp(np.linspace(np.log(0.3), np.log(0.01), 300))  # stall removed
    assert metrics.plateaus(short) == []


def test_separation_and_power_law():
    a = [1.0, 1.0, 1.005, 1.02, 1.5]
    assert metrics.separation_step(a, [1.0] * 5) == 3
    assert metrics.separation_step([1.0] * 5, [1.0] * 5) is None
    assert metrics.max_rel_gap([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    d = [16, 64, 256, 1024]
    assert metrics.power_law_exponent(d, [3 * x ** 0.5 for x in d]) == pytest.approx(0.5)
    assert metrics.power_law_exponent(d, [0.2 * x for x in d]) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# Validation and results


@pytest.mark.parametrize("bad, fragment", [
    (dict(pairs=40), "pairs"), (dict(lr=0.0), "lr"), (dict(lr=-1e-3), "lr"),
    (dict(steps=0), "steps"), (dict(mechanism="scaeld"), "Did you mean: scaled"),
    (dict(optimizer="adamw"), "optimizer"), (dict(batch_size=0), "batch-size"),
    (dict(options={"cap": 30.0}), "cap"),
])
def test_bad_config_is_one_line_config_error(bad, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        train(TINY, **bad)
    assert "\n" not in str(err.value)


def test_runs_must_share_shapes():
    with pytest.raises(ConfigError, match="share"):
        train_runs([TINY, replace(TINY, d_k=4)])


@pytest.mark.parametrize("runs", [
    [RecallConfig(steps=2)] * 2,
    [RecallConfig(steps=2, seed=1), RecallConfig(steps=2, mechanism="unscaled"),
     RecallConfig(steps=2, seed=1)],
    [RecallConfig(mechanism="softcap", options={"cap": 5.0}, steps=2),
     RecallConfig(mechanism="softcap", options={"cap": 5.0}, steps=2)],
])
def test_a_repeated_run_is_refused(runs):
    # One run listed twice would be counted twice in every statistic over the runs.
    with pytest.raises(ConfigError, match=r"^configs lists the run mechanism='\w+', seed=\d, "
                                          r"options=\{.*\} more than once"):
        train_runs(runs)


def test_runs_that_differ_only_in_options_are_distinct():
    runs = train_runs([replace(TINY, mechanism="softcap", options={"cap": c}) for c in (2.0, 5.0)])
    assert [r.config.options["cap"] for r in runs] == [2.0, 5.0]


def test_a_run_has_one_record_that_the_other_views_agree_with():
    run = train(TINY)
    diverged = replace(run, loss=run.loss[:-1] + [math.nan], final_loss=math.nan)
    record = json.loads(json.dumps(diverged.record(), allow_nan=False))
    assert record["loss"][-1] is None and record["final_loss"] is None
    back = RunResult.from_record(TINY, record, diverged.wall_seconds)
    assert math.isnan(back.loss[-1]) and math.isnan(back.final_loss)
    assert back.loss[:-1] == run.loss[:-1] and back.trace == run.trace
    assert back.record() == diverged.record()
    assert back.smoothed[:-1] == pytest.approx(run.smoothed[:-1], rel=1e-12)
    assert diverged.to_json()["loss_curve"] == record["loss"]
    row = diverged.row()
    assert row["final_loss"] is None and row["plateaus"] == len(run.plateaus)
    assert {f"eval_{k}" for k in run.eval_stats} <= set(row)


def test_result_json_schema():
    run = train(TINY)
    obj = run.to_json()
    assert list(obj) == ["mechanism", "seed", "steps_to_loss_1", "steps_to_loss_0_1",
                         "final_loss", "eval_accuracy", "grad_wq_norm_step0", "plateaus",
                         "wall_seconds", "loss_curve", "config"]
    assert len(obj["loss_curve"]) == TINY.steps and obj["steps_to_loss_0_1"] is None
    assert RecallConfig(**json.loads(json.dumps(obj))["config"]) == TINY  # re-runnable from it
    assert 0.0 <= obj["eval_accuracy"] <= 1.0
    json.dumps(obj, allow_nan=False)
    assert [row["step"] for row in run.trace] == [0, 2, 4, 5]
    assert math.isfinite(run.eval_stats["qk_std"])


def test_fast_model_equals_naive_for_a_gate_per_coordinate():
    """gated's elementwise gate multiplies the output before the readout (the default gate, per
    head, is covered by the registry-wide test above)."""
    options = {"granularity": "element"}
    _check_against_naive([replace(TINY, mechanism="gated", options=options, seed=s)
                          for s in (0, 1)])
