"""The analyses over several inspect reports: models compared side by side, a training run's
trajectory with the exact split of each head's logit-std growth, and one model at several lengths.

Every report is measured by the real :func:`attnscale.inspect.inspect_model` on tiny models built
from configs (nothing is downloaded); the run is a tiny Llama trained a few AdamW steps in memory
between snapshots.  Each analysis is also made from its reports read back as records.json holds
them (NaN as null), and must give the same rows and page, and its figure is drawn from them.
"""

from __future__ import annotations

import copy
import json
import math
import statistics

import pytest
import torch
import transformers

from attnscale import hf
from attnscale.errors import ConfigError
from attnscale.inspect import inspect_model
from attnscale.inspect.compare import compare_rows, draw_compare, render_compare
from attnscale.inspect.lengths import (DISPERSING_SLOPE, draw_lengths, length_rows,
                                       render_lengths)
from attnscale.inspect.report import fmt
from attnscale.inspect.report import dumps
from attnscale.inspect.trajectory import (FACTORS, coherence_factor, draw_trajectory,
                                          render_trajectory, step_medians, trajectory_rows)
from attnscale.io import json_safe

hf.register()

VOCAB = 64
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.2)
WINDOW = 8          # the sliding layer's window in the length study
LENGTHS = (4, 8, 16, 32)
STEPS = (3, 6, 9)   # optimizer steps at which the run is snapshotted
PNG = b"\x89PNG\r\n\x1a\n"


def build(config, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnscale")
    return model.eval()


def token_ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def stored(payload: dict) -> dict:
    """The payload as records.json holds it (NaN as null, tuples as lists)."""
    return json.loads(dumps(payload))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for this module's fixtures too: they are set up before conftest's
    per-test fixture sets it, and two threads on a loaded machine wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(run) -> dict[str, dict]:
    """Two reports of different families, each away from its own initialisation: the run's last
    Llama checkpoint (the divisor owns the temperature) and a Qwen3 whose per-head q/k RMSNorm
    gains differ per channel (the norm owns it)."""
    qwen3 = build(transformers.Qwen3Config(head_dim=8, **TINY))
    with torch.no_grad():
        for name, p in qwen3.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 2.0)
    return {"llama": run[-1][1],
            "qwen3": inspect_model(qwen3, token_ids(24), meta={"name": "tiny-qwen3"},
                                   show_progress=False)}


@pytest.fixture(scope="module")
def run(one_thread) -> list[tuple[int, dict]]:
    """A tiny Llama trained by AdamW on a fixed batch, measured at each of STEPS (its init pass,
    seed 0, the same fresh model every time)."""
    model = build(transformers.LlamaConfig(**TINY))
    batch = token_ids(24, seed=2)
    probe = token_ids(24)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    out, done = [], 0
    for step in STEPS:
        model.train()
        for _ in range(step - done):
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        done = step
        model.eval()
        out.append((step, inspect_model(model, probe, seed=0, meta={"name": f"checkpoint-{step}"},
                                        show_progress=False)))
    return out


@pytest.fixture(scope="module")
def by_length(one_thread) -> dict[int, dict]:
    """A Gemma 3 whose layer 0 slides over WINDOW keys and layer 1 attends all, with layer 1's
    W_Q zeroed (its logits are all 0: uniform attention, entropy exactly ln n), read at LENGTHS
    on prefixes of the same tokens."""
    config = transformers.Gemma3TextConfig(head_dim=8, query_pre_attn_scalar=8,
                                           sliding_window=WINDOW,
                                           layer_types=["sliding_attention", "full_attention"],
                                           **TINY)
    model = build(config)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.zero_()
    ids = token_ids(max(LENGTHS))
    return {n: inspect_model(model, ids[:, :n], init=False, meta={"name": "tiny-gemma3"},
                             show_progress=False) for n in LENGTHS}


# --- compare -----------------------------------------------------------------------------------

def test_compare_rows_are_each_models_medians(models):
    payloads = [models["llama"], models["qwen3"]]
    rows = compare_rows(payloads)
    assert [r["name"] for r in rows] == [f"checkpoint-{STEPS[-1]}", "tiny-qwen3"]
    for row, p in zip(rows, payloads):
        recs = p["records"]
        assert row["family"] == p["meta"]["model_type"]
        assert row["owner"] == ", ".join(p["layers"][0]["mechanisms"])
        assert (row["layers"], row["heads_per_layer"], row["d_head"]) == (2, 4, [8])
        assert row["saturated_heads"] == sum(r["saturated"] for r in recs)
        for key in ("logit_std", "init_logit_std", "coherence", "q_rms", "k_rms",
                    "entropy_ratio"):
            assert row[f"median_{key}"] == statistics.median(r[key] for r in recs)
        # The norms' part of each head's growth from its init, recomputed from the records.
        norms = statistics.median(math.log(r["q_rms"] / r["init_q_rms"])
                                  + math.log(r["k_rms"] / r["init_k_rms"]) for r in recs)
        torch.testing.assert_close(row["median_log_norms"], norms, rtol=1e-12, atol=1e-12)
    assert "qk-rmsnorm" in rows[1]["owner"] and rows[0]["owner"] == "scaled"
    json.dumps(json_safe(rows), allow_nan=False)


def test_compare_page_and_figure_redraw_from_the_stores(models, tmp_path):
    payloads = [models["llama"], models["qwen3"]]
    page = render_compare(payloads)
    rows = compare_rows(payloads)
    lo = min(rows, key=lambda r: r["median_coherence"])
    assert f"Median coherence runs from {fmt(lo['median_coherence'])} ({lo['name']})" in page
    hi = max(rows, key=lambda r: r["median_drift_logit_std"])
    assert f"to ×{fmt(hi['median_drift_logit_std'])} ({hi['name']})" in page
    assert "| tiny-qwen3 | qwen3 | `qk-rmsnorm(over=head)` | 2 × 4 | 8 | 24 |" in page
    back = [stored(p) for p in payloads]
    assert render_compare(back) == page
    assert json_safe(compare_rows(back)) == json_safe(rows)
    figure = draw_compare(back, tmp_path / "compare.png")
    assert figure.read_bytes()[:8] == PNG


def test_compare_refuses_bad_inputs_in_one_line(models):
    for payloads, fragment in (([models["llama"]], "at least 2"),
                               ([models["qwen3"], models["qwen3"]], "two models named"),
                               ([models["llama"], {"meta": {}}], "payloads[1] is not an inspect")):
        with pytest.raises(ConfigError, match="payloads") as err:
            compare_rows(payloads)
        assert fragment in str(err.value) and "\n" not in str(err.value)


# --- trajectory --------------------------------------------------------------------------------

def test_coherence_factor_is_the_coherence_when_the_split_is_exact():
    stats = {"logit_std": 0.35 * math.sqrt(64) * 1.3 * 0.7 * 1.9, "d_head": 64, "q_rms": 1.3,
             "k_rms": 0.7}
    torch.testing.assert_close(coherence_factor(stats, 0.35), 1.9, rtol=1e-14, atol=0.0)


def test_the_factors_log_ratios_sum_to_the_logit_std_log_growth_per_head(run):
    rows = trajectory_rows(run)
    first = run[0][1]
    assert [r["step"] for r in rows] == [s for s in (0, *STEPS) for _ in first["records"]]
    trained = [r for r in rows if r["step"] > 0]
    growth = torch.tensor([r["log_growth"] for r in trained], dtype=torch.float64)
    parts = torch.tensor([sum(r[f"log_{f}"] for f in FACTORS) for r in trained],
                         dtype=torch.float64)
    torch.testing.assert_close(parts, growth, rtol=0.0, atol=1e-12)
    assert growth.abs().max() > 0.05  # training moved the logits: the check is not 0 = 0
    # Step 0 is the first checkpoint's init pass; a checkpoint's step is its own record.
    for r, rec in zip(rows, first["records"]):
        assert r["logit_std"] == rec["init_logit_std"] and r["q_rms"] == rec["init_q_rms"]
        assert r["log_growth"] == 0.0
    step, last = run[-1]
    for r, rec in zip([r for r in rows if r["step"] == step], last["records"]):
        assert (r["coherence"], r["k_rms"]) == (rec["coherence"], rec["k_rms"])
        torch.testing.assert_close(r["log_q_rms"], math.log(rec["q_rms"] / rec["init_q_rms"]),
                                   rtol=1e-12, atol=1e-12)
        # The residual factor is the measured coherence up to the rows' mixing: the one-key
        # first row adds 0 to the mean logit std (1/24 of it) and the rows' factors spread.
        assert 0.8 < r["coherence_gap"] < 1.2
    json.dumps(json_safe(rows), allow_nan=False)


def test_a_scale_that_changes_takes_its_part_of_the_split(run):
    learned = copy.deepcopy(run[-1][1])
    for layer in learned["layers"]:   # a learned temperature that doubled by the last step
        layer["scale"] *= 2.0
    rows = [r for r in trajectory_rows([*run[:-1], (STEPS[-1], learned)])
            if r["step"] == STEPS[-1]]
    plain = [r for r in trajectory_rows(run) if r["step"] == STEPS[-1]]
    for r, p in zip(rows, plain):
        torch.testing.assert_close(r["log_scale"], math.log(2.0), rtol=1e-12, atol=0.0)
        assert r["log_growth"] == p["log_growth"]  # the records did not change, the split did
        torch.testing.assert_close(r["log_coherence"], p["log_coherence"] - math.log(2.0),
                                   rtol=0.0, atol=1e-12)
        torch.testing.assert_close(sum(r[f"log_{f}"] for f in FACTORS), r["log_growth"],
                                   rtol=0.0, atol=1e-12)


def test_trajectory_verdict_states_the_medians_and_redraws_from_the_stores(run, tmp_path):
    page = render_trajectory(run)
    rows = trajectory_rows(run)
    last = [r for r in rows if r["step"] == STEPS[-1]]
    norms = statistics.median(r["log_norms"] for r in last)
    align = statistics.median(r["log_coherence"] for r in last)
    growth = statistics.median(r["log_growth"] for r in last)
    assert f"×{fmt(math.exp(growth))} (log-growth {fmt(growth)})" in page
    assert f"{fmt(norms)} through the norms of q and k" in page
    assert ("drifted mainly through the norms" in page) == (abs(norms) > abs(align))
    assert step_medians(rows)[-1]["norms_heads"] == sum(
        abs(r["log_norms"]) > abs(r["log_coherence"]) for r in last)
    head = last[-1]  # the per-head table at the last step
    assert f"| 1 | 3 | {fmt(math.exp(head['log_growth']))} | {fmt(head['log_growth'])} |" in page
    back = [(s, stored(p)) for s, p in run]
    assert render_trajectory(back) == page
    assert json_safe(trajectory_rows(back)) == json_safe(rows)
    assert draw_trajectory(back, tmp_path / "trajectory.png").read_bytes()[:8] == PNG


def test_trajectory_refuses_bad_runs_in_one_line(run, models):
    other = models["qwen3"]
    changed = copy.deepcopy(run[1][1])
    changed["records"][0]["init_logit_std"] *= 1.01
    no_init = copy.deepcopy(run[1][1])
    for r in no_init["records"]:
        r["init_logit_std"] = None
    for pairs, fragment in (([], "at least one"),
                            ([run[0], (3, run[1][1])], "step 3 more than once"),
                            ([run[1], run[0]], "step order"),
                            ([(0, run[0][1])], "must be >= 1"),
                            ([run[0], (7, other)], "another architecture"),
                            ([run[0], (7, changed)], "initialisation measured with step 7"),
                            ([(4, no_init)], "without its initialisation")):
        with pytest.raises(ConfigError, match="steps_and_payloads") as err:
            trajectory_rows(pairs)
        assert fragment in str(err.value) and "\n" not in str(err.value)


# --- lengths -----------------------------------------------------------------------------------

def test_length_slopes_are_least_squares_over_the_lengths_the_keys_grow(by_length):
    rows = length_rows(by_length)
    sliding = [r for r in rows if r["layer"] == 0]
    full = [r for r in rows if r["layer"] == 1]
    # What the family's window says, the records show: beyond it layer 0 attends fewer keys.
    at = {n: {r["layer"]: r["mean_ln_keys"] for r in p["records"]} for n, p in by_length.items()}
    assert at[WINDOW][0] == at[WINDOW][1] and at[32][0] < at[32][1]
    assert all(r["lengths_fitted"] == [4, 8] and r["window"] == WINDOW for r in sliding)
    assert all(r["lengths_fitted"] == list(LENGTHS) for r in full)
    for r in rows:
        used = [LENGTHS.index(n) for n in r["lengths_fitted"]]
        x = torch.tensor([r["mean_ln_keys"][i] for i in used], dtype=torch.float64)
        y = torch.tensor([r["entropy"][i] for i in used], dtype=torch.float64)
        design = torch.stack([torch.ones_like(x), x], dim=1)
        slope = torch.linalg.lstsq(design, y.unsqueeze(1)).solution[1, 0]
        torch.testing.assert_close(torch.tensor(r["entropy_slope"], dtype=torch.float64), slope)
        assert r["dispersing"] == (r["entropy_slope"] >= DISPERSING_SLOPE)
        assert r["peak_key"] == "logit_absmax"
    # Uniform attention (W_Q = 0): entropy is ln n row by row, so the slope is 1, no logit grows.
    for r in full:
        torch.testing.assert_close(r["entropy_slope"], 1.0, rtol=0.0, atol=1e-6)
        assert r["dispersing"] and r["peak_slope"] == 0.0 and r["entropy_slope_se"] is not None
    assert all(r["entropy_slope_se"] is None for r in sliding)  # two lengths: no dof left
    # A window the family's facts do not know is read from the records: n_keys stops growing.
    unknown = {n: copy.deepcopy(p) for n, p in by_length.items()}
    for p in unknown.values():
        for layer in p["layers"]:
            layer["sliding_window"] = None
    again = length_rows(unknown)
    assert [r["lengths_fitted"] for r in again] == [r["lengths_fitted"] for r in rows]
    assert again[0]["note"] == f"keys stop at {WINDOW} (measured); fitted over 2 lengths"
    assert again[4]["note"] == "fitted over 4 lengths"
    json.dumps(json_safe(rows), allow_nan=False)


def test_length_page_names_the_heads_and_says_where_the_window_stops_the_fit(by_length,
                                                                             tmp_path):
    page = render_lengths(by_length)
    assert "| 0 | 8 | window 8, keys stop at 8; fitted over 2 lengths |" in page
    assert "layer 1: heads 0, 1, 2, 3" in page.split("**Dispersing**")[1].split("\n")[0]
    # A head whose entropy stays put holds; it is named among the holding heads.
    held = {n: copy.deepcopy(p) for n, p in by_length.items()}
    for p in held.values():
        p["records"][5]["entropy_mean"] = 1.5
    row = length_rows(held)[5]
    assert (row["layer"], row["head"], row["dispersing"]) == (1, 1, False)
    assert "layer 1: heads 1" in render_lengths(held).split("**Holding**")[1].split("\n")[0]
    # Above the window at every length but one: layer 0 is not fitted, and the page says so.
    wide = {n: by_length[n] for n in (8, 16, 32)}
    page_wide = render_lengths(wide)
    assert "window 8, keys stop at 8; not fitted: fewer than 2 lengths where its keys still " \
           "grow" in page_wide
    assert all(r["dispersing"] is None for r in length_rows(wide) if r["layer"] == 0)
    back = {n: stored(p) for n, p in by_length.items()}
    assert render_lengths(back) == page
    assert json_safe(length_rows(back)) == json_safe(length_rows(by_length))
    assert draw_lengths(back, tmp_path / "lengths.png").read_bytes()[:8] == PNG


def test_lengths_refuse_bad_inputs_in_one_line(by_length, models):
    p8, p16 = by_length[8], by_length[16]
    shifted = copy.deepcopy(p8)
    shifted["meta"]["token_ids"][0][0] = (shifted["meta"]["token_ids"][0][0] + 1) % VOCAB
    for given, fragment in (({8: p8, "8": p8}, "lists 8 more than once"),
                            ({8: p8}, "at least 2 lengths"),
                            ({8: p8, 12: p16}, "measured at 16 tokens"),
                            ({8: shifted, 16: p16}, "not a prefix"),
                            ({8: p8, 24: models["llama"]}, "another model"),
                            ({0: p8, 16: p16}, "must be >= 1")):
        with pytest.raises(ConfigError, match="payloads_by_length") as err:
            length_rows(given)
        assert fragment in str(err.value) and "\n" not in str(err.value)
