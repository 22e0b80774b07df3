"""The pipeline's additive logit bias (T5's relative position bias, ALiBi): outputs against the
formula in float64 on every normaliser and kernel, what observers receive, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from attnscale.attention import attention
from attnscale.errors import ConfigError
from attnscale.measure.monitor import monitor
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


def test_the_monitor_sees_the_biased_softmax():
    q, k, v, bias, _ = tensors()

    class Attend(torch.nn.Module):  # the monitor observes calls made inside its model's forward
        def forward(self, q, k, v):
            return attention(q, k, v, bias=bias, causal=True)

    with monitor(Attend()) as mon:
        mon.model(q, k, v)
    z = (q @ k.transpose(-1, -2) / 2 + bias).masked_fill(
        ~torch.ones(N, N, dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(z, -1)
    entropy = -torch.special.xlogy(p, p).sum(-1).mean((0, 2))  # (H,)
    got = torch.tensor([r["entropy_mean"] for r in mon.records], dtype=torch.float64)
    torch.testing.assert_close(got, entropy)


@pytest.mark.parametrize("bias,match", [
    (torch.zeros(1, H, N, N, dtype=torch.long), "floating"),
    (torch.zeros(1, H, N, N + 1), "does not broadcast"),
    ([0.0], "floating"),
])
def test_bad_bias_is_a_one_line_error(bias, match):
    q, k, v, _, _ = tensors()
    with pytest.raises(ConfigError, match=match):
        attention(q.float(), k.float(), v.float(), bias=bias)
