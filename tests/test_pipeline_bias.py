"""The pipeline's additive logit bias (T5's relative position bias, ALiBi): outputs against the
formula in float64 on every normaliser and kernel, with a mechanism's own logit bias (forgetting,
selective) and differential attention's two maps, what observers receive, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnscale.attention import MultiHeadAttention, attention, observe
from attnscale.errors import ConfigError
from attnscale.measure.monitor import Watch, monitor
from attnscale.measure.monitor.blocks import first_key_weight, logit_stats
from attnscale.mechanisms import build_mechanism
from attnscale.pipeline import normalise

B, H, N, D = 2, 3, 7, 4


def tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    bias = 2 * torch.randn(1, H, N, N, generator=g, dtype=torch.float64)
    mask = torch.rand(B, 1, N, N, generator=g) > 0.3
    return q, k, v, bias, mask


def formula(q, k, v, mech, bias, mask, causal):
    """z = cap(scale q kᵀ + offset) + bias, masked, normalised, @ v; rows without keys give 0."""
    keep = torch.ones(B, H, N, N, dtype=torch.bool)
    if mask is not None:
        keep = keep & mask
    if causal:
        keep = keep & torch.ones(N, N, dtype=torch.bool).tril()
    n_keys = keep.sum(-1, keepdim=True)
    qs, ks, scale = mech.prepare(q, k, n_keys)
    z = qs @ ks.transpose(-1, -2) * scale
    if mech.has_offset:  # sigmoid attention's -log n
        z = z + mech.offset(n_keys)
    if mech.cap is not None:
        z = mech.cap * torch.tanh(z / mech.cap)
    z = z + bias
    sink = mech.sink_logits() if mech.normaliser == "sink" else None
    p = normalise(z.masked_fill(~keep, -math.inf), mech.normaliser, sink).nan_to_num(0.0)
    return p @ v


@pytest.mark.parametrize("name,options", [("scaled", {}), ("softcap", {"cap": 1.5}),
                                          ("sink", {}), ("sigmoid", {})])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_bias_joins_the_logits_after_the_cap(name, options, causal, masked):
    q, k, v, bias, mask = tensors()
    mech = build_mechanism(name, D, H, **options).double()
    m = mask if masked else None
    want = formula(q, k, v, mech, bias, m, causal)
    torch.testing.assert_close(attention(q, k, v, mech, mask=m, causal=causal, bias=bias), want)
    traced = attention(q, k, v, mech, mask=m, causal=causal, bias=bias, trace=True)
    torch.testing.assert_close(traced.out, want)


def test_a_zero_bias_changes_nothing_and_a_bias_changes_the_output():
    q, k, v, bias, mask = tensors()
    plain = attention(q, k, v, mask=mask)
    torch.testing.assert_close(attention(q, k, v, mask=mask, bias=torch.zeros_like(bias)), plain)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(attention(q, k, v, mask=mask, bias=bias), plain)


class Calls(torch.nn.Module):
    """A model whose forward is one attention call: what the monitor and a Watch observe."""

    def forward(self, q, k, v, **how):
        return attention(q, k, v, **how)


def test_the_monitor_sees_the_biased_softmax():
    q, k, v, bias, _ = tensors()
    with monitor(Calls()) as mon:
        mon.model(q, k, v, bias=bias, causal=True)
    z = (q @ k.transpose(-1, -2) / 2 + bias).masked_fill(
        ~torch.ones(N, N, dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(z, -1)
    entropy = -torch.special.xlogy(p, p).sum(-1).mean((0, 2))  # (H,)
    got = torch.tensor([r["entropy_mean"] for r in mon.records], dtype=torch.float64)
    torch.testing.assert_close(got, entropy)


OWN_BIAS = ["forgetting", "selective", "differential"]


def own_bias_case(name: str, masked: bool, causal: bool):
    """A mechanism with a logit bias of its own (or two maps), its call's keyword arguments and
    the logits its own rule gives without the caller's bias (the traced pipeline's, which
    tests/test_forgetting.py, test_selective.py and test_differential.py check against the
    formulas), with the keys each query attends."""
    q, k, v, bias, mask = tensors()
    torch.manual_seed(0)
    mech = MultiHeadAttention(H * D, H, name, dtype=torch.float64).mechanism  # gates, λ drawn
    how = {"mask": mask if masked else None, "causal": causal}
    if name == "forgetting":
        gen = torch.Generator().manual_seed(5)
        how["log_forget"] = F.logsigmoid(torch.randn(B, H, N, generator=gen, dtype=torch.float64))
    own = attention(q, k, v, mech, trace=True, **how).logits  # (B, H, N, N), 2N for two maps
    keep = torch.ones(B, H, N, N, dtype=torch.bool)
    if masked:
        keep = keep & mask
    if causal:
        keep = keep & torch.ones(N, N, dtype=torch.bool).tril()
    return q, k, v, bias, mech, how, own, keep


def with_callers_bias(mech, own, bias, keep):
    """The masked logits once the caller's bias joins the mechanism's (in both maps of a
    differential call), and their weights."""
    two_maps = mech.normaliser == "differential"
    z = own + (torch.cat([bias, bias], -1) if two_maps else bias)
    z = z.masked_fill(~(torch.cat([keep, keep], -1) if two_maps else keep), -math.inf)
    lam = mech.lam() if two_maps else None
    return z, normalise(z, mech.normaliser, None, lam).nan_to_num(0.0)


# forgetting is causal only (tests/test_forgetting.py checks that it refuses causal=False)
OWN_BIAS_CASES = [(name, causal) for name in OWN_BIAS for causal in (False, True)
                  if causal or name != "forgetting"]


@pytest.mark.parametrize("name,causal", OWN_BIAS_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_a_callers_bias_adds_to_the_mechanisms_own(name, causal, masked):
    q, k, v, bias, mech, how, own, keep = own_bias_case(name, masked, causal)
    _, p = with_callers_bias(mech, own, bias, keep)
    with torch.no_grad():
        want = mech.normalise_output(p @ v)
        torch.testing.assert_close(attention(q, k, v, mech, bias=bias, **how), want)
        torch.testing.assert_close(attention(q, k, v, mech, bias=bias, trace=True, **how).out,
                                   want)
        plain = attention(q, k, v, mech, **how)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(plain, want)


@pytest.mark.parametrize("name,causal", OWN_BIAS_CASES)
def test_observers_see_both_biases_and_s_max_without_either(name, causal):
    """A Watch's Call: biased, λ where there is one, its statistics and first-key weight of the
    logits the normaliser sees (both biases), its S_max (QK-Clip's, the logit W_Q and W_K make)
    of scale · q kᵀ without either bias."""
    q, k, v, bias, mech, how, own, keep = own_bias_case(name, True, causal)
    z, p = with_callers_bias(mech, own, bias, keep)
    calls, stats, seen = [], [], []

    def on_call(call):  # statistics asked for during the call, as the monitor and guard do
        calls.append(call)
        call.statistics(stats.append, block=3)

    with Watch(Calls(), on_call) as watch, observe(seen.append), torch.no_grad():
        watch.model(q, k, v, mechanism=mech, bias=bias, **how)
    (call,), (obs,), (got,) = calls, seen, stats
    assert call.biased and not call.peaks_in_statistics
    if name == "differential":
        torch.testing.assert_close(call.lam, mech.lam().detach())
    else:
        assert call.lam is None
    want = logit_stats(z, normaliser=mech.normaliser,
                       lam=mech.lam().detach() if name == "differential" else None)
    assert set(got.totals) == set(want.totals)
    torch.testing.assert_close(got.queries, want.queries)
    for field, total in want.totals.items():
        torch.testing.assert_close(got.totals[field], total, msg=field)
    half = D // 2 if name == "differential" else D
    maps = [(q[..., :half], k[..., :half]), (q[..., half:], k[..., half:])][:1 + (half < D)]
    peaks = torch.stack([(qm @ km.transpose(-1, -2) / math.sqrt(half)).masked_fill(
        ~keep, -math.inf).amax((0, 2, 3)) for qm, km in maps]).amax(0)
    torch.testing.assert_close(call.peak_logits(), peaks)
    total, rows = first_key_weight(obs, block=3)
    sees = keep[..., 0]  # the rows that attend the first key
    torch.testing.assert_close(total, torch.where(sees, p[..., 0], 0.0).sum((0, 2)))
    torch.testing.assert_close(rows, sees.sum((0, 2)).to(rows.dtype))
@pytest.mark.parametrize("bias,match", [
    (torch.zeros(1, H, N, N, dtype=torch.long), "floating"),
    (torch.zeros(1, H, N, N + 1), "does not broadcast"),
    ([0.0], "floating"),
])
def test_bad_bias_is_a_one_line_error(bias, match):
    q, k, v, _, _ = tensors()
    with pytest.raises(ConfigError, match=match):
        attention(q.float(), k.float(), v.float(), bias=bias)
