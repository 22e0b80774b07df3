"""Invariants of :func:`attnscale.attention.attention`, parametrised over the whole registry."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from attnscale.attention import attention, attention_reference
from attnscale.errors import ConfigError
from attnscale.mechanisms import MECHANISMS, build_mechanism
from attnscale.stats import row_mass

NAMES = list(MECHANISMS)
B, H, NQ, NK, D = 2, 3, 6, 8, 8


def _inputs(dtype=torch.float64, seed=0, nq=NQ, nk=NK, d_v=D, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, nq, D, generator=gen, dtype=torch.float64) * scale).to(dtype)
    k = (torch.randn(B, H, nk, D, generator=gen, dtype=torch.float64) * scale).to(dtype)
    v = torch.randn(B, H, nk, d_v, generator=gen, dtype=torch.float64).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _mechanism(name, dtype=torch.float64):
    mech = build_mechanism(name, D, H).to(dtype)
    with torch.no_grad():  # learned temperatures away from init, so they are exercised too
        for p in mech.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return mech


def _mask(seed=0):
    """(B, 1, NQ, NK) random mask with query row 2 of batch 0 fully masked."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, 1, NQ, NK, generator=gen) > 0.4
    mask[0, :, 2] = False
    mask[..., 0] |= ~mask.any(-1)  # every other row keeps at least one key
    mask[0, :, 2] = False
    return mask


def _grads(out, tensors, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, tensors, g, allow_unused=True)


@pytest.mark.parametrize("name", NAMES)
def test_shapes_and_names(name):
    q, k, v = _inputs(d_v=5)
    mech = _mechanism(name)
    assert mech(q, k, v).shape == (B, H, NQ, 5)
    # the differential normaliser's logits are its two maps side by side
    width = 2 * NK if mech.normaliser == "differential" else NK
    assert mech.logits(q, k).shape == (B, H, NQ, width)
    assert attention(q, k, v, name).shape == (B, H, NQ, 5)  # a registry name works too


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("masking", ["none", "causal", "mask", "mask+causal"])
def test_fused_kernels_equal_the_materialised_trace(name, masking):
    """``attention_reference`` is ``attention(..., trace=True)``: this checks the fused kernels
    against the same pipeline written out, values and gradients, not either against the
    mechanism's formula (the float64 formula table in test_mechanisms.py does that)."""
    q, k, v = _inputs()
    mech = _mechanism(name)
    mask = _mask() if "mask" in masking else None
    causal = "causal" in masking
    wrt = (q, k, v, *mech.parameters())
    fast = mech(q, k, v, mask=mask, causal=causal)
    ref = attention_reference(q, k, v, mech, mask=mask, causal=causal).out
    assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(_grads(fast, wrt), _grads(ref, wrt)):
        assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", NAMES)
def test_rows_sum_to_one(name):
    # With v = identity over the keys the output is the weight matrix itself.  Rows sum to the
    # normaliser's key mass: 1 under softmax, 1 - the sink's weight, Σ σ(z) under sigmoid,
    # 1 - λ under differential attention (whose weights p1 - λ p2 may be negative, and whose
    # output is normalised after p @ v: its weights are read from the trace).
    q, k, _ = _inputs()
    eye = torch.eye(NK, dtype=torch.float64).expand(B, H, NK, NK)
    mech = _mechanism(name)
    sink = mech.sink_logits() if mech.normaliser == "sink" else None
    lam = mech.lam() if mech.normaliser == "differential" else None
    for causal in (False, True):
        p = (attention_reference(q, k, eye, mech, causal=causal).weights
             if mech.normalises_output else mech(q, k, eye, causal=causal))
        assert (p >= 0).all() or mech.normaliser == "differential"
        z = attention_reference(q, k, eye, mech, causal=causal).logits
        if causal:
            tril = torch.ones(NQ, NK, dtype=torch.bool).tril()
            z = z.masked_fill(~(torch.cat([tril, tril], -1) if lam is not None else tril),
                              -math.inf)
        assert_close(p.sum(-1), row_mass(z, mech.normaliser, sink, lam))
        if mech.normaliser == "softmax":
            assert_close(p.sum(-1), torch.ones(B, H, NQ, dtype=torch.float64))
    trace = attention_reference(q, k, eye, mech, mask=_mask())
    sums = trace.weights.sum(-1)
    assert_close(sums[0, :, 2], torch.zeros(H, dtype=torch.float64))  # the fully masked row
    hidden = ~_mask() if lam is None else torch.cat([~_mask(), ~_mask()], -1)
    z = trace.logits.masked_fill(hidden, -math.inf)
    assert_close(sums[1], row_mass(z, mech.normaliser, sink, lam)[1])


@pytest.mark.parametrize("name", NAMES)
def test_causal_equals_explicit_mask(name):
    q, k, v = _inputs(nq=NK)
    mech = _mechanism(name)
    tril = torch.ones(NK, NK, dtype=torch.bool).tril()
    assert_close(mech(q, k, v, causal=True), mech(q, k, v, mask=tril), rtol=1e-12, atol=1e-12)
    # Top-left aligned, as SDPA's is_causal: query i sees keys 0..i, also when Nq != Nk.
    q2, k2, v2 = _inputs(nq=NQ)
    tril2 = torch.ones(NQ, NK, dtype=torch.bool).tril()
    assert_close(mech(q2, k2, v2, causal=True), mech(q2, k2, v2, mask=tril2), rtol=1e-12,
                 atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fully_masked_rows_give_zero_output_and_zero_gradients(name, dtype):
    q, k, v = _inputs(dtype)
    mech = _mechanism(name, dtype)
    mask = _mask()
    out = mech(q, k, v, mask=mask)
    dq, dk, dv = _grads(out, (q, k, v))
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    assert (out[0, :, 2] == 0).all()
    assert (dq[0, :, 2] == 0).all()
    # Keys of batch 0 get gradient only from the rows that attend them: zeroing row 2's
    # upstream gradient changes nothing.
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    g_cut = g.clone()
    g_cut[0, :, 2] = 0
    full = torch.autograd.grad(mech(q, k, v, mask=mask), (k, v), g)
    cut = torch.autograd.grad(mech(q, k, v, mask=mask), (k, v), g_cut)
    for a, b in zip(full, cut):
        assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_finite_and_close_to_float32(name, dtype):
    q, k, v = _inputs(torch.float32)
    mech = _mechanism(name, torch.float32)
    ref = mech(q, k, v)
    qh, kh, vh = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = mech(qh, kh, vh)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    grads = _grads(out, (qh, kh, vh))
    assert all(torch.isfinite(g).all() for g in grads)
    masked = mech(qh, kh, vh, mask=_mask(), causal=True)
    assert torch.isfinite(masked).all() and (masked[0, :, 2] == 0).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_huge_logits_stay_finite(name, dtype):
    # |q.k| reaches ~1e5 in float32 (beyond fp16's max of 65504 for the raw products).
    q, k, v = _inputs(torch.float32, scale=60.0)
    assert (q @ k.transpose(-2, -1)).abs().max() > 1e4
    with torch.no_grad():
        k[..., :NQ, :] = q[..., :NQ, :] * 1.5  # aligned pairs push the top logit past 1e5
    assert (q @ k.transpose(-2, -1)).abs().max() > 1e5
    mech = _mechanism(name, torch.float32)
    qh, kh, vh = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    for kwargs in ({}, {"causal": True}, {"mask": _mask()}):
        out = mech(qh, kh, vh, **kwargs)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert all(torch.isfinite(g).all() for g in _grads(out, (qh, kh, vh)))
    assert torch.isfinite(mech.logits(qh, kh)).all()


@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name):
    q, k, v = _inputs(torch.float32)
    mech = _mechanism(name, torch.float32)
    mask = _mask()
    first = mech(q, k, v, mask=mask)
    grads = _grads(first, (q, k, v))
    again = mech(q, k, v, mask=mask)
    assert torch.equal(first, again)
    assert all(torch.equal(a, b) for a, b in zip(grads, _grads(again, (q, k, v))))


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (3, 4, 4))
    mech = _mechanism(name)
    names = [n for n, _ in mech.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in mech.named_parameters())
    mask = torch.tensor([[True, False, True, True], [False, False, False, False],
                         [True, True, False, True]])

    def run(q, k, v, *values, **kwargs):  # the output as a function of inputs and parameters
        return torch.func.functional_call(mech, dict(zip(names, values)), (q, k, v), kwargs)

    # fast_mode checks random projections uᵀ J v of the Jacobian: as strict, much cheaper.
    assert torch.autograd.gradcheck(run, (q, k, v, *params), fast_mode=True)
    assert torch.autograd.gradcheck(lambda *a: run(*a, mask=mask, causal=True), (q, k, v, *params),
                                    fast_mode=True)


def test_bad_masks_and_shapes_are_config_errors():
    q, k, v = _inputs()
    with pytest.raises(ConfigError, match="mask must be a boolean"):
        attention(q, k, v, mask=torch.ones(NQ, NK))
    with pytest.raises(ConfigError, match="does not broadcast"):
        attention(q, k, v, mask=torch.ones(NQ + 1, NK, dtype=torch.bool))
    with pytest.raises(ConfigError, match="do not fit"):
        attention(q, k[..., :3, :], v)
    with pytest.raises(ConfigError, match=r"Did you mean: cosine\?"):
        attention(q, k, v, "cosin")
