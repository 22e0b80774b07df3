"""Differential attention (arXiv 2410.05258) against its formula written out in float64: values
and gradients of q, k, v and the λ vectors, masks, causal Nq != Nk, an all-masked row, one key,
fp16 / bf16 / float64; λ_init's schedule over the LM's depth; its statistics (w = p1 − λ p2)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from attnscale.attention import MultiHeadAttention, attention, observe
from attnscale.errors import ConfigError
from attnscale.experiments.lm.model import LMConfig, build_lm
from attnscale.mechanisms import build_mechanism
from attnscale.stats import row_mass, row_stats
from mechanism_inputs import (B, D, H, assert_lower_precision, grads, nan_rows, qkv,
                              random_mask)


def differential_reference(q, k, v, m, mask=None, causal=False):
    """(1 − λ_init) RMSNorm((softmax(q1k1ᵀ/√(d/2)) − λ softmax(q2k2ᵀ/√(d/2))) v), λ =
    exp(λq1·λk1) − exp(λq2·λk2) + λ_init, λ_init = 0.8 − 0.6 exp(−0.3 (l − 1)), RMSNorm over the
    head's d_v outputs with eps 1e-5 and no gain; a row with no key gives 0."""
    half = q.shape[-1] // 2
    init = 0.8 - 0.6 * math.exp(-0.3 * (m.layer - 1))
    lam = (torch.exp((m.lambda_q1 * m.lambda_k1).sum()) - torch.exp((m.lambda_q2 * m.lambda_k2)
           .sum()) + init)
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    keep = keep.tril() if causal else keep
    if mask is not None:
        keep = keep & mask

    def softmax(z):
        p = torch.softmax(z.masked_fill(~keep, -math.inf), -1)
        return torch.where(keep.any(-1, keepdim=True), p, 0.0)

    scale = 1 / math.sqrt(half)
    w = (softmax(q[..., :half] @ k[..., :half].transpose(-2, -1) * scale)
         - lam * softmax(q[..., half:] @ k[..., half:].transpose(-2, -1) * scale))
    o = w @ v
    return o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 - init)


def _mechanism(layer=3):
    torch.manual_seed(0)
    mha = MultiHeadAttention(H * D, H, "differential", layer=layer, dtype=torch.float64)
    return mha.mechanism                                  # with its λ vectors drawn


@pytest.mark.parametrize("n_q, n_k", [(6, 6), (5, 7), (7, 5), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("trace", [False, True])
def test_differential_matches_its_formula_in_float64(n_q, n_k, causal, masked, trace):
    q, k, v = qkv(n_q, n_k)
    mask = random_mask(n_q, n_k, heads=H) if masked else None
    m = _mechanism()
    got = attention(q, k, v, m, mask=mask, causal=causal, trace=trace)
    got = got.out if trace else got
    want = differential_reference(q, k, v, m, mask, causal)
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    wrt = (q, k, v, *m.parameters())
    for a, b in zip(grads(got, wrt), grads(want, wrt)):
        assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 5e-2),
                                        (torch.float16, 1e-2)])
def test_differential_in_lower_precision(dtype, tol):
    q, k, v = qkv(9, 9)
    m = _mechanism()
    want = differential_reference(q, k, v, m, causal=True)
    args = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    low = build_mechanism("differential", D, H, layer=3).to(dtype)
    low.load_state_dict({key: t.to(dtype) for key, t in m.state_dict().items()})
    assert_lower_precision(attention(*args, low, causal=True), args, want, (q, k, v), dtype, tol)


def test_lambda_init_follows_the_depth_and_the_options():
    assert build_mechanism("differential", D, H).lambda_init == pytest.approx(0.2)
    assert build_mechanism("differential", D, H, layer=4).lambda_init == pytest.approx(
        0.8 - 0.6 * math.exp(-0.9))
    assert build_mechanism("differential", D, H, lambda_init=0.5).lambda_init == 0.5
    bare = build_mechanism("differential", D, H, layer=2).double()   # no projections: λ vectors 0
    assert_close(bare.lam(), torch.tensor(bare.lambda_init, dtype=torch.float64))
    lm = build_lm(LMConfig(d_model=16, n_layers=3, n_heads=2, mechanism="differential"))
    inits = [block.attn.mechanism.lambda_init for block in lm.blocks]
    assert inits == pytest.approx([0.8 - 0.6 * math.exp(-0.3 * depth) for depth in range(3)])
    assert all(block.attn.mechanism.lambda_q1.abs().sum() > 0 for block in lm.blocks)
    with pytest.raises(ConfigError, match="d_head must be even"):
        build_mechanism("differential", 7, H)


def test_statistics_are_those_of_p1_minus_lambda_p2():
    q, k, _ = (t.detach() for t in qkv(5, 7))
    m = _mechanism()
    lam = m.lam().detach()
    z = m.logits(q, k)                                                 # (B, H, 5, 14)
    half = z.shape[-1] // 2
    p1, p2 = torch.softmax(z[..., :half], -1), torch.softmax(z[..., half:], -1)
    w = p1 - lam * p2
    rows = row_stats(z, normaliser="differential", lam=lam)
    assert_close(rows[..., 0], torch.full_like(rows[..., 0], 7.0))     # count: the keys
    assert_close(rows[..., 1], w.amax(-1))                             # max weight
    share = w.abs() / w.abs().sum(-1, keepdim=True)
    assert_close(rows[..., 2], -(share * share.log()).sum(-1))          # entropy of |w| / Σ|w|

    def jac(p):
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    fro = torch.cat([jac(p1), -lam * jac(p2)], -1).pow(2).sum((-2, -1)).sqrt()
    assert_close(rows[..., 3], fro)                                     # ||∂w/∂(z1, z2)||_F
    assert_close(rows[..., 6], z.amax(-1))                              # S_max over both maps
    assert_close(row_mass(z, "differential", lam=lam), (1 - lam).expand(B, H, 5))
    empty = torch.full((1, 1, 1, 14), -math.inf, dtype=torch.float64)
    assert torch.equal(row_stats(empty, normaliser="differential", lam=lam),
                       torch.zeros(1, 1, 1, 7, dtype=torch.float64))


def test_refusals():
    from attnscale import hf
    with pytest.raises(ConfigError, match="DiffLlama"):
        hf.check_swappable("differential")


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_a_nan_reaches_the_rows_whose_logits_it_enters(where):
    m = _mechanism()
    fused = nan_rows(lambda q, k, v: attention(q, k, v, m, causal=True), where)
    assert fused == nan_rows(lambda q, k, v: attention(q, k, v, m, causal=True, trace=True).out,
                             where)
    # the NaN rule (attnscale.kernels.nans): a query's own row, a key's or value's later rows
    assert fused == ([i == 2 for i in range(6)] if where == "q" else [i >= 2 for i in range(6)])


def test_an_observer_gets_the_rows_of_both_maps():
    q, k, v = (t.detach() for t in qkv(6, 9))
    m = _mechanism()
    mask = random_mask(6, 9, heads=H)
    seen = []

    def observer(obs):
        assert obs.offers_rows and obs.normaliser == "differential"
        obs.request_rows(seen.append)

    with observe(observer):
        attention(q, k, v, m, mask=mask, causal=True)
    z = attention(q, k, v, m, mask=mask, causal=True, trace=True).logits
    keep = mask & torch.ones(6, 9, dtype=torch.bool).tril()
    z = z.masked_fill(~torch.cat([keep, keep], -1), -math.inf)
    assert_close(seen[0], row_stats(z, normaliser="differential", lam=m.lam().detach()))


@pytest.mark.parametrize("n_q, n_k", [(6, 6), (5, 7), (7, 5)])
@pytest.mark.parametrize("causal", [True, False])
def test_the_flash_path_in_chunks_of_heads_on_worker_threads(monkeypatch, n_q, n_k, causal):
    # the CPU path without a mask: one head per chunk (6 chunks), on 2 workers, float64 inputs
    from attnscale.kernels import chunked
    from attnscale.workers import num_threads
    monkeypatch.setattr(chunked, "IN_FLIGHT_ELEMENTS", 1)
    assert len(chunked.head_chunks(B, H, n_q * D, 2)) == B * H
    q, k, v = qkv(n_q, n_k, seed=5)
    m = _mechanism()
    wrt = (q, k, v, m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2)
    with num_threads(2):
        got = attention(q, k, v, m, causal=causal)
        got_grads = grads(got, wrt)
    want = differential_reference(q, k, v, m, causal=causal)
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, grads(want, wrt)):
        assert_close(a, b, rtol=1e-10, atol=1e-12)
