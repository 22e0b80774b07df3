"""attnscale.guard: records, alarms, QK-Clip on attnscale and Hugging Face models, bad input.

Tiny models built from configs (nothing downloaded), a few steps at a learning rate high enough
that the attention logits grow.  The clip's bound is checked against an independent float64
recomputation of every head's largest logit from the q and k the model itself passes to its
attention function (captured through HF's AttentionInterface, not through attnscale).
"""

from __future__ import annotations

import json
import math
import os
import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from torch.testing import assert_close
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import attnscale
import guard_ddp
from attnscale import MultiHeadAttention, hf
from attnscale.errors import ConfigError
from attnscale.guard import GUARD_KEYS, GuardAlarm, clip_sites, layer_rows, read_log, to_frame
from attnscale.io import atomic_write, json_safe

hf.register()
SEQ = 16
VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=64)


# ---------------------------------------------------------------------------------------------
# An independent view of the logits: the q and k each layer hands to its attention function.

_CAPTURED: list[dict] | None = None


def _capture(delegate):
    def forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if _CAPTURED is not None:
            _CAPTURED.append({"q": query.detach().double(), "k": key.detach().double(),
                              "scaling": module.head_dim ** -0.5 if scaling is None else scaling,
                              "mask": attention_mask})
        return delegate(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return forward


AttentionInterface.register("capture-sdpa", _capture(sdpa_attention_forward))
AttentionInterface.register("capture-attnscale", _capture(hf.attnscale_attention_forward))
AttentionMaskInterface.register("capture-sdpa", sdpa_mask)
AttentionMaskInterface.register("capture-attnscale", sdpa_mask)


def true_max_logits(model, batch: dict) -> torch.Tensor:
    """(layers, H) float64: every head's largest pre-softmax (pre-cap) logit over the keys each
    query attends, from the q and k the model computes, in eval mode."""
    global _CAPTURED
    _CAPTURED = []
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(**batch)
        calls = _CAPTURED
    finally:
        _CAPTURED = None
        model.train(training)
    out = []
    for c in calls:
        q, k = c["q"], c["k"]
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        z = (q @ k.transpose(-1, -2)) * c["scaling"]             # (B, H, N, N)
        mask = c["mask"]
        if mask is None:
            mask = torch.ones(z.shape[-2:], dtype=torch.bool).tril()
        elif mask.dtype != torch.bool:
            mask = mask > -1e4
        out.append(z.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3)))
    return torch.stack(out)


def make_hf(family: str, attn: str = "capture-sdpa", seed: int = 0):
    if family == "llama":    # grouped-query attention: 4 query heads, 2 key/value heads
        config = transformers.LlamaConfig(**COMMON)
    elif family == "mistral":
        config = transformers.MistralConfig(**COMMON)
    elif family == "qwen2":  # q/k/v biases
        config = transformers.Qwen2Config(**COMMON)
    elif family == "qwen3":  # q_norm / k_norm over each head's channels, one gain for all heads
        config = transformers.Qwen3Config(**COMMON)
    elif family == "olmo2":  # q_norm / k_norm over all heads' channels
        config = transformers.Olmo2Config(**COMMON)
    elif family == "gemma2":  # soft-cap; runs on attn_implementation="attnscale"
        config = transformers.Gemma2Config(attn_logit_softcapping=20.0, query_pre_attn_scalar=8,
                                           final_logit_softcapping=None, sliding_window=8,
                                           **COMMON)
        attn = "capture-attnscale"
    elif family == "gemma3":  # q/k norms with a (1 + w) gain
        config = transformers.Gemma3TextConfig(query_pre_attn_scalar=8, sliding_window=8,
                                               **COMMON)
    else:
        raise ValueError(family)
    config.attention_dropout = 0.0
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def batches(n: int, batch: int = 4, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append({"input_ids": x, "labels": x})
    return out


def train(model, data, *, lr: float, hook=None, **guard_options):
    """A plain loop: Adam at ``lr``, one batch per step; returns (guard or None, losses)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    if hook is not None:
        opt.register_step_post_hook(lambda o, a, k: hook())
    losses = []
    g = attnscale.guard(model, optimizer=opt, **guard_options) if guard_options else None
    with g if g is not None else _null():
        for step, batch in enumerate(data):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if g is not None:
                g.step(step)
    return g, torch.stack(losses)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


# ---------------------------------------------------------------------------------------------
# Records


def test_guard_without_clip_changes_no_loss_and_no_weight_bit():
    data = batches(4)
    plain = make_hf("llama")
    _, want = train(plain, data, lr=0.05)
    guarded = make_hf("llama")
    g, got = train(guarded, data, lr=0.05, every=1, alarm_logit=None)
    assert torch.equal(got, want)
    for (name, a), (_, b) in zip(plain.named_parameters(), guarded.named_parameters()):
        assert torch.equal(a, b), name
    assert len(g.records) == 4 * 2 * 4  # steps x layers x heads


def test_records_are_tidy_and_match_a_float64_recomputation():
    model = make_hf("qwen2")
    data = batches(1)
    want = true_max_logits(model, data[0])  # before the step: the weights step 0 ran with
    model.train()
    g, _ = train(model, data, lr=1e-3, every=3, alarm_logit=None)
    frame = g.to_frame()
    assert list(frame.columns) == list(GUARD_KEYS)
    assert len(frame) == 2 * 4 and set(frame["step"]) == {0}
    got = torch.tensor(frame.sort_values(["layer", "head"])["logit_max"].to_list(),
                       dtype=torch.float64).view(2, 4)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (frame["logit_std_ratio"] == 1.0).all()  # the first recorded step is the reference
    assert (frame["queries"] == 4 * SEQ).all()
    assert frame["s_max"].isna().all() and (frame["alarm"] == "").all()
    assert (frame["logit_absmax"] >= frame["logit_max"]).all()
    assert ((frame["entropy_min"] >= 0) & (frame["entropy_min"] <= frame["entropy_mean"])).all()
    spread = layer_rows(g.records)
    assert [(r["step"], r["layer"], r["heads"]) for r in spread] == [(0, 0, 4), (0, 1, 4)]
    assert spread[0]["logit_max"] == frame[frame.layer == 0]["logit_max"].max()


def test_logit_std_ratio_is_each_steps_std_over_the_heads_first():
    """At every recorded step after the first (where it is 1 by construction), each head's
    ratio is its logit_std over its first recorded logit_std, and the per-layer maximum is the
    largest head's; Adam at a high LR moves it well away from 1."""
    g, _ = train(make_hf("llama"), batches(4), lr=0.05, every=1, alarm_logit=None)
    first = {(r["module"], r["head"]): r["logit_std"] for r in g.records if r["step"] == 0}
    later = [r for r in g.records if r["step"] > 0]
    assert len(first) == 2 * 4 and len(later) == 3 * 2 * 4
    for r in later:
        assert r["logit_std_ratio"] == pytest.approx(
            r["logit_std"] / first[r["module"], r["head"]], rel=1e-12)
    assert max(abs(math.log(r["logit_std_ratio"])) for r in later) > math.log(2)
    last = [r for r in later if r["step"] == 3 and r["layer"] == 1]
    assert g.latest["attnscale/logit_std_ratio_max/layer1"] == max(
        r["logit_std_ratio"] for r in last)


def test_every_selects_the_first_step_and_the_multiples():
    g, _ = train(make_hf("llama"), batches(7), lr=1e-3, every=3, alarm_logit=None)
    assert sorted({r["step"] for r in g.records}) == [0, 3, 6]


def test_n_keys_is_each_steps_own():
    """A record's n_keys is the most keys a query attended in that step's calls, so a step of
    shorter sequences after longer ones records its own (causal: the sequence length)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2)
    with attnscale.guard(mha, every=1, alarm_logit=None) as g:
        for step, n in enumerate((9, 4, 6)):
            mha(torch.randn(2, n, 16), causal=True)
            g.step(step)
    assert [r["n_keys"] for r in g.records] == [9, 9, 4, 4, 6, 6]


def test_only_attended_keys_count_under_a_padding_mask():
    """Keys hidden by a padding mask carry huge logits; no statistic may see them."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(2, 6, 16)
    x[:, 4:] *= 200.0                           # padded positions: enormous keys
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[..., 4:] = False                       # nobody attends them
    q = mha._split(mha.w_q(x))
    k = mha._split(mha.w_k(x))
    z = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(8)
    want = z.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3))
    with attnscale.guard(mha, every=1, alarm_logit=None) as g:
        mha(x, mask=mask)
        g.step(0)
    got = torch.tensor([r["logit_max"] for r in g.records], dtype=torch.float64)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    absmax = torch.tensor([r["logit_absmax"] for r in g.records], dtype=torch.float64)
    assert_close(absmax, z.masked_fill(~mask, 0).abs().amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6)


def test_qk_clip_mechanism_tracks_s_max_over_attended_keys_only():
    """The qk-clip mechanism's S_max under a padding mask is the max over the keys attended."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, "qk-clip").train()
    x = torch.randn(2, 6, 16)
    x[:, :2] *= 200.0                           # left padding: the first two keys
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[..., :2] = False
    q, k = mha._split(mha.w_q(x)), mha._split(mha.w_k(x))
    z = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(8)
    mha(x, mask=mask)
    assert_close(mha.mechanism.s_max, z.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3)),
                 rtol=1e-5, atol=1e-6)
    assert float(mha.mechanism.s_max.max()) < 0.01 * float(z.detach().amax())


def test_a_log_is_jsonl_registered_and_reloadable(tmp_path):
    log = tmp_path / "runs" / "guard.jsonl"
    g, _ = train(make_hf("llama"), batches(3), lr=1e-3, every=2, log=log, alarm_logit=None)
    lines = log.read_text().splitlines()
    assert len(lines) == len(g.records) == 2 * 2 * 4
    frame = to_frame(log)
    assert frame["step"].to_list() == [r["step"] for r in g.records]
    assert read_log(log)[0]["module"] == "model.layers.0.self_attn"
    # attnscale wrote it, so a second run replaces it without force
    train(make_hf("llama"), batches(1), lr=1e-3, log=log, alarm_logit=None)
    assert len(log.read_text().splitlines()) == 2 * 4


def test_a_log_from_before_a_key_was_recorded_reads_it_as_nan(tmp_path):
    g, _ = train(make_hf("llama"), batches(1), lr=1e-3, alarm_logit=None)
    row = {k: v for k, v in json_safe(g.records[0]).items() if k != "jacobian_fro_mean"}
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps(row) + "\n")
    (back,) = read_log(old)
    assert math.isnan(back["jacobian_fro_mean"]) and back["logit_max"] == row["logit_max"]
    del row["entropy_mean"]                       # a key every log has: still an error
    old.write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match="entropy_mean"):
        read_log(old)


def test_records_reach_a_tensorboard_writer(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    train(make_hf("llama"), batches(2), lr=1e-3, every=1, writer=writer, alarm_logit=None)
    writer.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "attnscale/logit_max/layer1/head3" in tags and "attnscale/logit_max/layer0" in tags
    assert [e.step for e in events.Scalars("attnscale/logit_max/layer0")] == [0, 1]


# ---------------------------------------------------------------------------------------------
# Alarms


def test_max_logit_alarm_warns_once_in_one_line():
    with pytest.warns(RuntimeWarning) as got:
        train(make_hf("llama"), batches(6), lr=0.05, every=1, alarm_logit=2.0)
    messages = [str(w.message) for w in got if "attnscale.guard" in str(w.message)]
    assert messages and all("\n" not in m for m in messages)
    assert "max_logit in layer" in messages[0] and "head" in messages[0] and "step" in messages[0]
    assert len(messages) == len(set(m.split(" at step")[0] for m in messages))  # once per head


def test_on_alarm_raise_stop_and_callable():
    with pytest.raises(GuardAlarm, match="max_logit"):
        train(make_hf("llama"), batches(6), lr=0.05, every=1, alarm_logit=2.0, on_alarm="raise")
    g, _ = train(make_hf("llama"), batches(6), lr=0.05, every=1, alarm_logit=2.0,
                 on_alarm="stop")
    assert g.should_stop
    seen = []
    train(make_hf("llama"), batches(6), lr=0.05, every=1, alarm_logit=2.0, on_alarm=seen.append)
    assert seen and seen[0]["alarm"] == "max_logit" and seen[0]["value"] > 2.0


def test_entropy_alarms():
    seen = []
    g, _ = train(make_hf("llama"), batches(8), lr=0.05, every=1, alarm_logit=None,
                 alarm_entropy_floor=2.0, alarm_entropy_fraction=0.9, on_alarm=seen.append)
    kinds = {a["alarm"] for a in seen}
    assert kinds == {"entropy_floor", "entropy_collapse"}
    for a in seen:
        row = next(r for r in g.records if (r["step"], r["layer"], r["head"])
                   == (a["step"], a["layer"], a["head"]))
        assert a["alarm"] in row["alarm"].split(",")


# ---------------------------------------------------------------------------------------------
# QK-Clip


def test_without_the_clip_the_max_logit_passes_tau():
    model = make_hf("llama")
    data = batches(8)
    train(model, data, lr=0.05)
    assert float(true_max_logits(model, data[-1]).max()) > 3.0  # the clip tests' τ


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2",
                                    "gemma3"])
def test_strict_clip_keeps_every_head_at_or_below_tau(family):
    tau = 3.0
    model = make_hf(family)
    data = batches(6)
    unclipped = make_hf(family)
    train(unclipped, data, lr=0.05)
    assert float(true_max_logits(unclipped, data[-1]).max()) > tau  # the clip has work to do
    g, _ = train(model, data, lr=0.05, qk_clip=tau, strict=True, every=1, alarm_logit=None)
    assert any(r["clip_gamma"] < 1 for r in g.records)
    # after the last step the bound holds on that step's batch
    assert float(true_max_logits(model, data[-1]).max()) <= tau * (1 + 1e-5)


def test_k2_clip_overshoots_by_one_steps_growth_at_most():
    """K2 mode: after the clip a head's max logit on its batch is S' · η, S' its max after the
    step (before the clip) and η = min(1, τ / max S over its group) from before the step, so it
    is at most τ · S' / S: one step's growth over τ."""
    tau = 2.0
    model = make_hf("llama")
    data = batches(6)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    step = {"i": 0}
    stepped, clipped = {}, {}
    # registered before the guard's hook: runs after the step, before the clip
    opt.register_step_post_hook(
        lambda *_: stepped.__setitem__(step["i"], true_max_logits(model, data[step["i"]])))
    with attnscale.guard(model, optimizer=opt, qk_clip=tau, every=1, alarm_logit=None) as g:
        for i, batch in enumerate(data):
            step["i"] = i
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            clipped[i] = true_max_logits(model, batch)
            g.step(i)
    fired = 0
    for i in range(len(data)):
        rows = [r for r in g.records if r["step"] == i]
        s = torch.tensor([r["s_max"] for r in rows], dtype=torch.float64).view(2, 4)
        eta = torch.tensor([r["clip_gamma"] for r in rows], dtype=torch.float64).view(2, 4)
        fired += int((eta < 1).sum())
        # the group rule: one η per key head, the group's largest S brought to τ
        group_peak = s.view(2, 2, 2).amax(-1).repeat_interleave(2, -1)
        assert_close(eta, torch.where(group_peak > tau, tau / group_peak, 1.0), rtol=1e-12,
                     atol=0)
        # layer 0 sees the embeddings only, so its logits scale exactly by η
        assert_close(clipped[i][0], stepped[i][0] * eta[0], rtol=1e-4, atol=1e-5)
        assert (clipped[i][0] <= tau * stepped[i][0] / s[0] * (1 + 1e-5)).all()
    assert fired > 0


def test_gqa_shared_key_rows_are_scaled_once():
    model = make_hf("llama")
    site = clip_sites(model)[0]
    k_before = model.model.layers[0].self_attn.k_proj.weight.detach().clone()
    q_before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    s = torch.tensor([20.0, 40.0, 1.0, 2.0], dtype=torch.float64)  # group 0 over τ = 10
    eta_q, eta_k = site.factors(s, 10.0)
    site.apply(eta_q, eta_k, 0.5)
    k_after = model.model.layers[0].self_attn.k_proj.weight
    q_after = model.model.layers[0].self_attn.q_proj.weight
    assert_close(k_after[:8], k_before[:8] * 0.25 ** 0.5)  # η = 10 / 40, once
    assert torch.equal(k_after[8:], k_before[8:])         # the quiet group is untouched
    assert_close(q_after[:16], q_before[:16] * 0.25 ** 0.5)
    assert torch.equal(q_after[16:], q_before[16:])


def test_qwen2_biases_scale_with_their_rows():
    model = make_hf("qwen2")
    site = clip_sites(model)[0]
    attn = model.model.layers[0].self_attn
    bias = attn.q_proj.bias.detach().clone()
    site.apply(*site.factors(torch.tensor([40.0, 1.0, 1.0, 1.0], dtype=torch.float64), 10.0),
               0.5)
    assert_close(attn.q_proj.bias[:8], bias[:8] * 0.5)
    assert torch.equal(attn.q_proj.bias[16:], bias[16:])


def test_clip_on_attnscale_multihead_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4)
    x = torch.randn(4, 12, 32)
    opt = torch.optim.SGD(mha.parameters(), lr=2.0)
    with attnscale.guard(mha, optimizer=opt, qk_clip=1.0, strict=True, every=1,
                         alarm_logit=None) as g:
        for step in range(4):
            mha(x, causal=True).square().mean().neg().backward()
            opt.step()
            opt.zero_grad()
            g.step(step)
    q, k = mha._split(mha.w_q(x)).double(), mha._split(mha.w_k(x)).double()
    z = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    z = z.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), -math.inf)
    assert float(z.amax()) <= 1.0 + 1e-5
    assert any(r["clip_gamma"] < 1 for r in g.records)


# ---------------------------------------------------------------------------------------------
# Data parallelism: two CPU processes on gloo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_data_parallel_clip_uses_the_max_over_ranks(tmp_path):
    """The ranks see different largest logits (rank 1's inputs 3x rank 0's, on the same
    weights): every rank records and clips with the larger, per head, as one process holding
    both batches does; the smaller (an all-reduce taking the min) would clip less."""
    # fork: the ranks start from this process's imports (spawn would import torch again)
    mp.start_processes(guard_ddp.worker, args=(_free_port(), str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert torch.equal(r0["w_q"], r1["w_q"]) and torch.equal(r0["w_k"], r1["w_k"])
    assert r0["s_max"] == r1["s_max"]
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2)
    per_rank = []
    for rank in (0, 1):
        x = guard_ddp.worker_batch(rank)
        q, k = mha._split(mha.w_q(x)).double(), mha._split(mha.w_k(x)).double()
        per_rank.append(((q @ k.transpose(-1, -2)) / math.sqrt(8)).amax((0, 2, 3)).detach())
    want, smaller = torch.maximum(*per_rank), torch.minimum(*per_rank)
    assert bool((want > smaller * 2).all())               # the ranks' maxima differ per head
    assert_close(torch.tensor(r0["s_max"], dtype=torch.float64), want, rtol=1e-5, atol=0)
    # the same clip in one process, both batches in its one step
    opt = torch.optim.SGD(mha.parameters(), lr=0.0)
    with attnscale.guard(mha, optimizer=opt, qk_clip=0.5, every=1, alarm_logit=None) as g:
        for rank in (0, 1):
            mha(guard_ddp.worker_batch(rank)).sum().backward()
        opt.step()
        g.step(0)
    assert_close(r0["w_q"], mha.w_q.weight.detach(), rtol=1e-6, atol=0)
    assert_close(r0["w_k"], mha.w_k.weight.detach(), rtol=1e-6, atol=0)


def test_data_parallel_records_and_alarms_are_the_global_batchs_on_every_rank(tmp_path):
    """Ranks with their own batches (of different lengths) record the same rows, those of the
    whole global batch, stop at the same step, and rank 0 alone writes the log."""
    mp.start_processes(guard_ddp.records_worker, args=(_free_port(), str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    r0, r1 = (torch.load(tmp_path / f"records{r}.pt") for r in (0, 1))
    assert r0["records"] == r1["records"] and r0["stop"] and r1["stop"]
    for key in r0["w"]:
        assert torch.equal(r0["w"][key], r1["w"][key]), key
    assert read_log(tmp_path / "guard.jsonl") == json.loads(json.dumps(r0["records"]))
    # One process running both ranks' batches in each step records the same numbers.
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2)
    opt = torch.optim.SGD(mha.parameters(), lr=0.1)
    with attnscale.guard(mha, optimizer=opt, qk_clip=2.0, every=1, alarm_logit=None) as g:
        for step in range(2):
            for rank in (0, 1):  # DDP averages the ranks' gradients: half of each
                (guard_ddp.rank_batch(rank, step, mha).sum() / 2).backward()
            opt.step()
            opt.zero_grad()
            g.step(step)
    for key in ("queries", "n_keys", "logit_max", "entropy_min", "entropy_mean", "logit_std",
                "logit_std_ratio", "s_max", "clip_gamma"):
        assert_close(torch.tensor([r[key] for r in r0["records"]], dtype=torch.float64),
                     torch.tensor([r[key] for r in g.records], dtype=torch.float64),
                     rtol=1e-5, atol=1e-6, msg=key)
    assert any("max_logit" in r["alarm"] for r in r0["records"])


def test_fsdp2_sharded_rows_are_clipped_as_the_unsharded_model(tmp_path):
    mp.start_processes(guard_ddp.fsdp_worker, args=(_free_port(), str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    got = torch.load(tmp_path / "fsdp.pt")
    # The same clip in one process: both ranks' batches in the step, so S_max is their max.
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 3, bias=True)
    opt = torch.optim.SGD(mha.parameters(), lr=0.0)
    with attnscale.guard(mha, optimizer=opt, qk_clip=0.5, every=1, alarm_logit=None) as g:
        for rank in (0, 1):
            x = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(10 + rank)) * 3
            mha(x).sum().backward()
        opt.step()
        g.step(0)
    assert any(r["clip_gamma"] < 1 for r in g.records)
    for name, p in mha.named_parameters():
        assert_close(got[name], p.detach(), rtol=1e-6, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------
# Bad input: one-line errors


# Bad options of attnscale.guard and the message each gets (the callbacks give the same).
BAD_OPTIONS = [
    ({"qk_clip": 0}, "qk_clip must be > 0"),
    ({"qk_clip": -1.0}, "qk_clip must be > 0"),
    ({"qk_clip": math.nan}, "qk_clip must be finite"),
    ({"qk_clip": math.inf}, "qk_clip must be finite"),
    ({"qk_clip": 10, "alpha": 1.5}, r"alpha must be in \[0, 1\]"),
    ({"qk_clip": 10, "alpha": -0.1}, r"alpha must be in \[0, 1\]"),
    ({"every": 0}, "every must be >= 1"),
    ({"every": 2.5}, "every must be an integer"),
    ({"strict": True}, "strict=True is a mode of the clip"),
    ({"on_alarm": "shout"}, "on_alarm must be one of"),
    ({"alarm_entropy_fraction": 1.5}, "alarm_entropy_fraction must be in"),
    ({"alarm_logit": 0}, "alarm_logit must be > 0"),
    ({"log": ""}, "log must be a path"),
    ({"log": "x.txt"}, "log 'x.txt' must end in one of .jsonl"),
    ({"block": 0}, "block must be >= 1"),
    ({"alarm_entropy_floor": -1}, "alarm_entropy_floor must be > 0"),
    ({"writer": object()}, "writer must have add_scalar"),
    ({"force": "yes"}, "force must be True or False"),
    ({"resume": -1}, "resume must be >= 0"),
    ({"resume": 2.5}, "resume must be an integer"),
]


@pytest.mark.parametrize("options, match", BAD_OPTIONS)
def test_bad_options_are_one_line_errors(options, match):
    with pytest.raises(ConfigError, match=match) as err:
        attnscale.guard(MultiHeadAttention(16, 2), **options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("state, match", [
    ({}, "version None"),
    ({"version": 1, "layers": {}, "first": [["a", 0]], "active": []}, "not enough values"),
    ({"version": 1, "layers": [], "first": [], "active": []}, "items"),
])
def test_load_state_dict_refuses_what_is_not_a_guard_state(state, match):
    with pytest.raises(ConfigError, match=f"not a guard state_dict.*{match}") as err:
        attnscale.guard(MultiHeadAttention(16, 2)).load_state_dict(state)
    assert "\n" not in str(err.value)


def test_log_paths_follow_the_io_rules(tmp_path):
    mine = tmp_path / "mine.jsonl"
    mine.write_text("the user's own notes\n")
    with pytest.raises(ConfigError, match="attnscale did not write it"):
        attnscale.guard(MultiHeadAttention(16, 2), log=mine)
    attnscale.guard(MultiHeadAttention(16, 2), log=mine, force=True)  # --force is the way out
    atomic_write(tmp_path / "ours.jsonl", "")
    attnscale.guard(MultiHeadAttention(16, 2), log=tmp_path / "ours.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        attnscale.guard(MultiHeadAttention(16, 2), log=tmp_path / "dir.jsonl")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not writable"):
            attnscale.guard(MultiHeadAttention(16, 2), log=locked / "g.jsonl")


def test_a_model_with_no_visible_attention_says_which_implementation_to_use():
    eager = make_hf("llama", attn="eager")
    with pytest.raises(ConfigError, match="attn_implementation='sdpa' or 'attnscale'"):
        attnscale.guard(eager)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with attnscale.guard(plain) as g:
        with pytest.raises(ConfigError, match="observed no attention call"):
            plain.train()(torch.randn(2, 4))
    assert g.records == []


@pytest.mark.parametrize("model, match", [
    (MultiHeadAttention(16, 2, "qknorm"), "do not scale with W_Q and W_K"),
    (MultiHeadAttention(16, 2, "qk-clip"), "already runs the 'qk-clip' mechanism"),
    (torch.nn.Linear(4, 4), "no attention layer whose W_Q and W_K"),
])
def test_models_the_clip_cannot_handle_are_refused(model, match):
    with pytest.raises(ConfigError, match=match) as err:
        attnscale.guard(model, qk_clip=10.0)
    assert "\n" not in str(err.value)


def test_warn_does_not_change_training():
    """Alarms firing (warn) leave training as it was."""
    data = batches(3)
    _, want = train(make_hf("llama"), data, lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, got = train(make_hf("llama"), data, lr=0.05, every=1, alarm_logit=0.01)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# The blocked max kernel


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("scale", ["float", "negative", "per-head", "per-row"])
@pytest.mark.parametrize("block_elements", [1 << 22, 300])
@pytest.mark.parametrize("path", ["native", "python"])
def test_head_peaks_equals_a_float64_masked_max(monkeypatch, causal, mask, scale, block_elements,
                                                path):
    # Calls without a mask take the C block loop where PyTorch exports its sgemm ("native"),
    # the blockwise Python pass otherwise ("python", as every masked call does).
    from attnscale.kernels import native, peak
    from attnscale.kernels.peak import head_peaks

    if path == "python":
        monkeypatch.setattr(native, "blas_sgemm", lambda: None)
    else:
        monkeypatch.setattr(peak, "PEAK_BLOCK_ROWS", 5)  # blocks across the diagonal

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 23, 8, generator=g), torch.randn(2, 2, 23, 8, generator=g)  # GQA
    s = {"float": 0.3, "negative": -0.5, "per-head": torch.rand(1, 4, 1, 1, generator=g) + 0.1,
         "per-row": torch.rand(2, 4, 23, 1, generator=g) - 0.3}[scale]
    z = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)
    z = z * (s.double() if isinstance(s, torch.Tensor) else s)
    keep = torch.ones(23, 23, dtype=torch.bool)
    given = None
    if mask is not None:
        keep = torch.rand(2, 1, 23, 23, generator=g) > 0.3
        keep[0, 0, 5] = False  # a query with no key at all
        given = keep if mask == "bool" else torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    if causal:
        keep = keep & torch.ones(23, 23, dtype=torch.bool).tril()
    want = z.masked_fill(~keep, -math.inf).amax(dim=(0, 2, 3))
    got = head_peaks(q, k, s, mask=given, causal=causal, block_elements=block_elements)
    assert got.dtype == torch.float64
    assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_head_peaks_propagates_nan_and_gives_minus_inf_without_keys():
    from attnscale.kernels.peak import head_peaks

    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    q[0, 1, 2, 0] = math.nan
    got = head_peaks(q, k, 0.5, mask=torch.zeros(1, 1, 4, 4, dtype=torch.bool))
    assert torch.isneginf(got).all()
    got = head_peaks(q, k, 0.5)
    assert torch.isfinite(got[0]) and torch.isnan(got[1])
