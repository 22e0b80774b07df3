"""The length-study mechanisms: ``llama4-temp`` (Llama 4's temperature tuning) and ``qk-clip``
(Kimi K2's QK-Clip), each against its formula in float64 and against the source it cites."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import transformers
from torch.testing import assert_close
from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

from attnscale import hf
from attnscale.attention import MultiHeadAttention, attention_reference, key_mask
from attnscale.errors import ConfigError
from attnscale.experiments.recall.config import RecallConfig
from attnscale.experiments.recall.trainer import train_runs
from attnscale.measure.montecarlo import saturation
from attnscale.mechanisms import build_mechanism
from attnscale.mechanisms.llama4_temp import LLAMA4_ATTN_SCALE, LLAMA4_FLOOR_SCALE, llama4_tau
from attnscale.mechanisms.qk_clip import K2_ALPHA, K2_TAU, QKClip, install

B, H, NQ, NK, D = 2, 3, 6, 9, 8
HALF_TYPES = (torch.float16, torch.bfloat16)


def _qkv(nq=NQ, nk=NK, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) * scale
               for n in (nq, nk, nk))
    return q, k, v


def _dot(q, k):
    return q @ k.transpose(-2, -1)


def _mask(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, 1, NQ, NK, generator=gen) > 0.4
    mask[1, :, 3] = False  # a query with no key
    return mask


# --- llama4-temp --------------------------------------------------------------------------------


def _hf_llama4_scales(positions, floor_scale, attn_scale):
    """The query multiplier as HF's Llama4TextAttention computes it (float32, 0-based positions)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def test_llama4_constants_are_hf_llama4s():
    config = transformers.Llama4TextConfig()
    assert (config.floor_scale, config.attn_scale) == (LLAMA4_FLOOR_SCALE, LLAMA4_ATTN_SCALE)
    assert config.attn_temperature_tuning
    m = build_mechanism("llama4-temp", D, H)
    assert (m.floor_scale, m.attn_scale) == (8192.0, 0.1)


def test_llama4_tau_at_the_floor_steps():
    # 1 below the first step, then 1 + 0.1 ln(1 + ⌊n / 8192⌋).
    assert llama4_tau(1) == 1.0 and llama4_tau(8191) == 1.0
    assert llama4_tau(8192) == pytest.approx(1 + 0.1 * math.log(2), rel=1e-15)
    assert llama4_tau(16383) == pytest.approx(1 + 0.1 * math.log(2), rel=1e-15)
    assert llama4_tau(16384) == pytest.approx(1 + 0.1 * math.log(3), rel=1e-15)
    n = torch.tensor([1, 8191, 8192, 16383, 16384, 10**6])
    assert_close(llama4_tau(n), torch.tensor([llama4_tau(int(i)) for i in n], dtype=torch.float64))


def test_llama4_matches_its_formula_in_float64():
    q, k, _ = _qkv()
    m = build_mechanism("llama4-temp", D, H).double()
    # Full attention: every query attends NK keys, far below the first step: scaled exactly.
    assert_close(m.logits(q, k), _dot(q, k) / math.sqrt(D), rtol=1e-14, atol=1e-14)
    # Per-row key counts across the steps of the default floor_scale.
    n = torch.tensor([1, 8191, 8192, 16384, 40000, 10**6]).view(NQ, 1)
    tau = 0.1 * torch.log(1 + torch.floor(n.double() / 8192)) + 1
    assert_close(m.logits(q, k, n), tau * _dot(q, k) / math.sqrt(D), rtol=1e-14, atol=1e-14)
    # Options, with n = NK = 9 for every query.
    m = build_mechanism("llama4-temp", D, H, floor_scale=2, attn_scale=0.7).double()
    assert_close(m.logits(q, k), (0.7 * math.log(1 + 4) + 1) * _dot(q, k) / math.sqrt(D),
                 rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("masking", ["causal", "mask", "mask+causal"])
def test_llama4_position_is_the_key_count(masking):
    # pos + 1 = the number of keys the query attends: i + 1 under causality, else its mask count.
    q, k, v = _qkv()
    m = build_mechanism("llama4-temp", D, H, floor_scale=2, attn_scale=0.5).double()
    mask = _mask() if "mask" in masking else None
    causal = "causal" in masking
    trace = attention_reference(q, k, v, m, mask=mask, causal=causal)
    n = key_mask(mask, causal, q, k).sum(-1, keepdim=True)  # (..., NQ, 1)
    tau = 0.5 * torch.log1p(torch.floor(n.double() / 2)) + 1
    assert_close(trace.logits, tau * _dot(q, k) / math.sqrt(D), rtol=1e-14, atol=1e-14)
    if masking == "causal":  # the 0-based query index i, read as HF's position
        pos = torch.arange(NQ)
        assert_close(tau[..., 0], _hf_llama4_scales(pos, 2, 0.5).double(), rtol=1e-6, atol=0)
    # The fused path agrees with the materialised trace.
    assert_close(m(q, k, v, mask=mask, causal=causal), trace.out, rtol=1e-12, atol=1e-12)


def test_llama4_equals_hf_llama4_attention_on_a_nope_layer():
    n, d_model, heads, floor_scale, attn_scale = 20, 32, 4, 4, 0.5  # τ steps every 4 positions
    config = transformers.Llama4TextConfig(
        hidden_size=d_model, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=d_model // heads, num_hidden_layers=1, no_rope_layers=[0],  # 0: a NoPE layer
        floor_scale=floor_scale, attn_scale=attn_scale, use_qk_norm=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = Llama4TextAttention(config, 0).double()
    ours = MultiHeadAttention(d_model, heads, "llama4-temp", floor_scale=floor_scale,
                              attn_scale=attn_scale, dtype=torch.float64)
    with torch.no_grad():
        for mine, theirs in ((ours.w_q, layer.q_proj), (ours.w_k, layer.k_proj),
                             (ours.w_v, layer.v_proj), (ours.w_o, layer.o_proj)):
            mine.weight.copy_(theirs.weight)
    x = torch.randn(2, n, d_model, dtype=torch.float64)
    causal = torch.full((n, n), -math.inf, dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = layer(x, position_embeddings=None, attention_mask=causal)
        # HF computes the multiplier in float32: agreement to float32 rounding of τ.
        assert_close(ours(x, causal=True), expected, rtol=1e-6, atol=1e-8)
        plain = MultiHeadAttention(d_model, heads, dtype=torch.float64)
        plain.load_state_dict(ours.state_dict())
        assert (plain(x, causal=True) - expected).abs().max() > 1e-3  # τ matters here


# --- qk-clip ------------------------------------------------------------------------------------


def _max_logit(mha, x, causal=False):
    """Per-head max pre-softmax logit qᵀk / √d of ``mha`` on ``x`` (B, N, d_model), by hand."""
    with torch.no_grad():
        q, k = (w(x).view(*x.shape[:2], mha.n_heads, mha.d_head).transpose(1, 2).double()
                for w in (mha.w_q, mha.w_k))
        z = _dot(q, k) / math.sqrt(mha.d_head)
        if causal:
            z = z.masked_fill(~torch.ones(z.shape[-2:], dtype=torch.bool).tril(), -math.inf)
        return z.amax(dim=(0, 2, 3))


def test_qk_clip_defaults_are_k2s_and_its_logits_are_scaled():
    assert (K2_TAU, K2_ALPHA) == (100.0, 0.5)
    q, k, _ = _qkv()
    m = build_mechanism("qk-clip", D, H).double()
    assert (m.tau, m.alpha) == (100.0, 0.5)
    assert_close(m.logits(q, k), _dot(q, k) / math.sqrt(D), rtol=1e-14, atol=1e-14)
    assert QKClip.defined_at_init is False and QKClip.scale_only


def _padding(lengths):
    """(B, 1, 1, NK) right-padding mask: sequence b has its first lengths[b] keys."""
    return (torch.arange(NK) < torch.tensor(lengths)[:, None]).view(len(lengths), 1, 1, NK)


@pytest.mark.parametrize("masking", ["none", "causal", "padding", "padding+causal"])
def test_qk_clip_tracks_the_max_logit_of_the_attended_keys(masking, monkeypatch):
    q, k, v = _qkv()
    q2, k2, v2 = _qkv(seed=1)
    mask = _padding([NK - 3, NK]) if "padding" in masking else None
    causal = "causal" in masking
    # Several blocks of queries, so the blockwise tracking is exercised.
    monkeypatch.setattr("attnscale.mechanisms.qk_clip.TRACK_BLOCK_ELEMENTS", B * H * NK * 2)
    m = build_mechanism("qk-clip", D, H).double()
    assert torch.isneginf(m.s_max).all()
    expected = torch.full((H,), -math.inf, dtype=torch.float64)
    for a, b, c in ((q, k, v), (q2, k2, v2)):  # two forwards before one clip: the max of both
        with torch.no_grad():
            ref = MultiHeadAttention(H * D, H, dtype=torch.float64).mechanism(a, b, c, mask=mask,
                                                                              causal=causal)
        assert_close(m(a, b, c, mask=mask, causal=causal), ref, rtol=1e-12, atol=1e-12)
        keep = key_mask(mask, causal, a, b)
        z = _dot(a, b) / math.sqrt(D)
        z = z if keep is None else z.masked_fill(~keep, -math.inf)
        expected = torch.maximum(expected, z.amax(dim=(0, 2, 3)))
        assert_close(m.s_max, expected, rtol=1e-14, atol=0)  # blockwise q kᵀ: rounding only
    expected = m.s_max.clone()
    m.eval()
    m(q * 10, k, v)  # evaluation forwards are not training forwards: not tracked
    assert torch.equal(m.s_max, expected)
    # Under any other mask too, only the keys the mask keeps count.
    m.train().reset()
    mask = _mask()
    m(q, k, v, mask=mask)
    z = (_dot(q, k) / math.sqrt(D)).masked_fill(~mask, -math.inf)
    assert_close(m.s_max, z.amax(dim=(0, 2, 3)), rtol=1e-14, atol=0)


def test_qk_clip_without_projections_is_a_clear_error():
    m = build_mechanism("qk-clip", D, H)
    with pytest.raises(ConfigError, match="clip\\(\\) needs the W_Q and W_K"):
        m.clip()
    model = torch.nn.Sequential(MultiHeadAttention(16, 2))
    with pytest.raises(ConfigError, match="no qk-clip mechanism"):
        install(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ConfigError, match="no W_Q and W_K bound"):
        install(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), m)
    with pytest.raises(ConfigError, match="features along dim 0"):
        m.bind(torch.ones(D * H + 1, 4), torch.ones(D * H, 4))


@pytest.mark.parametrize(("name", "value"), [("tau", 0), ("tau", -1.0), ("alpha", 1.5),
                                             ("alpha", -0.1), ("floor_scale", 0),
                                             ("attn_scale", -0.1), ("attn_scale", math.inf)])
def test_bad_options_name_the_option(name, value):
    mechanism = "qk-clip" if name in ("tau", "alpha") else "llama4-temp"
    with pytest.raises(ConfigError, match=name):
        build_mechanism(mechanism, D, H, **{name: value})


def _loud_mha(tau, alpha=K2_ALPHA, dtype=torch.float64, bias=True):
    """A qk-clip layer whose heads 0 and 2 have logits far above ``tau`` and head 1 below it."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(4 * D, 4, "qk-clip", tau=tau, alpha=alpha, bias=bias, dtype=dtype)
    with torch.no_grad():
        loud = torch.tensor([6.0, 0.05, 4.0, 3.0]).repeat_interleave(D)[:, None].to(dtype)
        mha.w_q.weight.mul_(loud)
        mha.w_k.weight.mul_(loud)
    return mha


@pytest.mark.parametrize("alpha", [K2_ALPHA, 1.0, 0.25])
def test_clip_brings_each_head_to_tau_on_the_batch_it_measured(alpha):
    tau = 5.0
    mha = _loud_mha(tau, alpha)
    x = torch.randn(3, 10, 4 * D, dtype=torch.float64)
    before = _max_logit(mha, x, causal=True)
    over = before > tau
    assert over.tolist() == [True, False, True, True]
    weights = {n: p.detach().clone() for n, p in mha.named_parameters()}
    mha(x, causal=True)
    assert_close(mha.mechanism.s_max, before, rtol=1e-14, atol=0)
    gamma = mha.mechanism.clip()
    assert_close(gamma, torch.where(over, tau / before, 1.0), rtol=0, atol=0)
    assert torch.isneginf(mha.mechanism.s_max).all()  # reset for the next step
    after = _max_logit(mha, x, causal=True)
    assert_close(after, torch.where(over, tau, before), rtol=1e-12, atol=0)
    # W_Q rows (and bias) of head h scale by γ^α, W_K's by γ^(1-α); head 1, W_V, W_O untouched.
    rows = gamma.repeat_interleave(D)
    for name, power in (("w_q", alpha), ("w_k", 1 - alpha)):
        for part in ("weight", "bias"):
            new = getattr(getattr(mha, name), part).detach()
            old = weights[f"{name}.{part}"]
            factor = rows ** power if part == "bias" else (rows ** power)[:, None]
            assert_close(new, old * factor, rtol=1e-15, atol=0)
            assert torch.equal(new[D:2 * D], old[D:2 * D])
    for name in ("w_v.weight", "w_o.weight"):
        assert torch.equal(dict(mha.named_parameters())[name], weights[name])
    # Nothing seen since the clip: a second clip changes nothing.
    assert_close(mha.mechanism.clip(), torch.ones(4, dtype=torch.float64), rtol=0, atol=0)


def _train(install_hook, strict, steps=12, lr=0.05, tau=4.0):
    """High-lr Adam on a loss that pushes attention logits up; per-step max logits on the batch."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(4 * D, 4, "qk-clip", tau=tau, dtype=torch.float64)
    x = torch.randn(4, 12, 4 * D, dtype=torch.float64)
    target = torch.randn(4, 12, 4 * D, dtype=torch.float64)
    opt = torch.optim.Adam(mha.parameters(), lr=lr)
    seen, gammas = [], []
    if install_hook:
        snapshot = {}
        # Runs before install's hook: the weights just after the update, before the clip.
        opt.register_step_post_hook(lambda *a: snapshot.update(
            {n: p.detach().clone() for n, p in mha.named_parameters()}))
        install(opt, mha)
    maxima = []
    for _ in range(steps):
        loss = -(mha(x, causal=True) * target).sum()
        opt.zero_grad()
        loss.backward()
        s_max = mha.mechanism.s_max.clone()
        assert_close(s_max, _max_logit(mha, x, causal=True), rtol=1e-13, atol=0)
        opt.step()
        if install_hook:  # K2's rule on the post-update weights, with the pre-update S_max
            gamma = torch.where(s_max > tau, tau / s_max, 1.0).repeat_interleave(D)[:, None]
            for name in ("w_q", "w_k"):
                assert_close(getattr(mha, name).weight.detach(),
                             snapshot[f"{name}.weight"] * gamma.sqrt(), rtol=1e-15, atol=0)
            gammas.append(gamma)
        if strict:  # measure after the step, then clip: the bound holds on this batch
            mha.mechanism.reset()
            with torch.no_grad():
                mha(x, causal=True)
            mha.mechanism.clip()
        maxima.append(_max_logit(mha, x, causal=True))
        seen.append(s_max)
    return torch.stack(maxima), torch.stack(seen), gammas


def test_training_loop_clips_after_every_step():
    tau = 4.0
    free, _, _ = _train(install_hook=False, strict=False, tau=tau)
    assert free.max() > 3 * tau  # without the clip the logits run far past τ
    # install(): every step applies K2's rule (checked inside _train); clips happened.
    hooked, _, gammas = _train(install_hook=True, strict=False, tau=tau)
    assert any((g < 1).any() for g in gammas)
    assert hooked.max() < free.max()
    # The strict loop (S_max measured after the step): after every step, no head's max logit on
    # the same batch exceeds τ.
    strict, _, _ = _train(install_hook=False, strict=True, tau=tau)
    assert (strict <= tau * (1 + 1e-12)).all(), strict.max()
    assert (strict > tau * (1 - 1e-9)).any()  # the clip binds, so the check is not vacuous


@pytest.mark.parametrize("dtype", [torch.float64, *HALF_TYPES])
def test_dtypes(dtype):
    q, k, v = _qkv(scale=0.5)
    ref = {"llama4-temp": build_mechanism("llama4-temp", D, H, floor_scale=2).double(),
           "qk-clip": build_mechanism("qk-clip", D, H).double()}
    for name, m64 in ref.items():
        m = build_mechanism(name, D, H, **({"floor_scale": 2} if name == "llama4-temp" else {}))
        m = m.to(dtype)
        qc, kc, vc = (t.to(dtype) for t in (q, k, v))
        half = dtype in HALF_TYPES
        z = m.logits(qc, kc)
        assert z.dtype == (torch.float32 if half else dtype)  # float32 accumulation
        tol = {"rtol": 0, "atol": 1e-5} if half else {"rtol": 1e-12, "atol": 1e-12}
        assert_close(z.double(), m64.logits(qc.double(), kc.double()), **tol)
        out = m(qc, kc, vc, causal=True)
        assert out.dtype == dtype and torch.isfinite(out).all()
        tol = {"rtol": 0.05, "atol": 0.05} if half else {"rtol": 1e-12, "atol": 1e-12}
        assert_close(out.double(), m64(q, k, v, causal=True), **tol)
    # qk-clip in half precision: S_max stays float64; the clip lands on τ up to rounding.
    mha = _loud_mha(5.0, dtype=dtype, bias=False)
    x = torch.randn(3, 10, 4 * D, dtype=dtype)
    mha(x, causal=True)
    assert mha.mechanism.s_max.dtype == torch.float64
    mha.mechanism.clip()
    after = _max_logit(mha, x, causal=True)
    eps = torch.finfo(dtype).eps
    assert (after <= 5.0 * (1 + 8 * eps)).all(), after


def test_recall_trainer_runs_qk_clip(monkeypatch):
    calls = []
    clip = QKClip.clip

    def spy(self):
        s_max = self.s_max.clone()
        gamma = clip(self)
        calls.append((s_max, gamma))
        return gamma

    monkeypatch.setattr(QKClip, "clip", spy)
    tiny = RecallConfig(d_k=8, d_model=12, pairs=5, n_keys=7, n_values=6, steps=20, batch_size=8,
                        eval_size=20, log_every=5, lr=0.05)
    tau = 1.0
    clipped, free = train_runs([replace(tiny, mechanism="qk-clip", options={"tau": tau}),
                                replace(tiny, mechanism="scaled")])
    assert len(calls) == tiny.steps  # once after every optimiser step
    assert all(torch.isfinite(s).all() for s, _ in calls)  # S_max seen in every training forward
    assert any((g < 1).any() for _, g in calls)
    for s_max, gamma in calls:
        assert_close(gamma, torch.where(s_max > tau, tau / s_max, 1.0), rtol=0, atol=0)
    assert clipped.eval_stats["logit_std"] < free.eval_stats["logit_std"]


def test_saturation_and_hf_treat_the_new_mechanisms_sensibly():
    # llama4-temp is a rule on q and k: sampled at init; equal to scaled below the first step.
    rows = {r["mechanism"]: r for r in saturation([16], 64, 200, 0, ("llama4-temp", "scaled"))}
    for stat in ("entropy", "max_weight"):
        se = math.hypot(rows["llama4-temp"][f"{stat}_se"], rows["scaled"][f"{stat}_se"])
        gap = abs(rows["llama4-temp"][f"{stat}_mean"] - rows["scaled"][f"{stat}_mean"])
        assert gap <= 4.5 * se + 1e-12, (stat, gap, se)
    # qk-clip lives in the weights: refused at init and by the Hugging Face swap.
    with pytest.raises(ConfigError, match="no temperature at init"):
        saturation([16], 64, 50, 0, ("qk-clip",))
    with pytest.raises(ConfigError, match="'qk-clip' acts on the W_Q and W_K"):
        hf.check_swappable("qk-clip")
    hf.check_swappable("llama4-temp", floor_scale=1024)
