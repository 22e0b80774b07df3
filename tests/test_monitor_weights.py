"""The monitor's statistics of the weights beside the logits: key mass, sink mass and gate mean."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from attnscale.attention import MultiHeadAttention
from attnscale.measure.monitor import monitor
from attnscale.mechanisms import build_mechanism


def _records(mha, x, **kw):
    with torch.no_grad(), monitor(mha) as mon:
        mha(x, **kw)
    return mon.records


def test_gate_mean_is_the_mean_of_the_output_gate_and_weights_are_unchanged():
    for granularity in ("head", "element"):
        torch.manual_seed(0)
        mha = MultiHeadAttention(16, 2, "gated", granularity=granularity, dtype=torch.float64)
        twin = MultiHeadAttention(16, 2, "scaled", dtype=torch.float64)
        twin.load_state_dict(mha.state_dict(), strict=False)  # same W_Q, W_K, W_V, W_O
        x = torch.randn(3, 7, 16, dtype=torch.float64)
        got, plain = _records(mha, x, causal=True), _records(twin, x, causal=True)
        gate = torch.sigmoid(x @ mha.mechanism.w_g.weight.T).view(3, 7, 2, -1)  # (B, N, H, ·)
        want = gate.mean(-1).mean((0, 1))                                        # per head
        assert_close(torch.tensor([r["gate_mean"] for r in got], dtype=torch.float64), want)
        for r, p in zip(got, plain):  # the gate acts on the output: the weights are scaled's
            assert r["entropy_mean"] == p["entropy_mean"] and p["gate_mean"] == 1.0


def test_key_mass_under_sink_and_sigmoid():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    mask = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, 0, 4] = False                                        # a query with no key
    for name in ("sink", "sigmoid", "scaled"):
        mha = MultiHeadAttention(16, 2, name, dtype=torch.float64)
        if name == "sink":
            with torch.no_grad():
                mha.mechanism.b.copy_(torch.tensor([-1.0, 2.0], dtype=torch.float64))
        records = _records(mha, x, mask=mask)
        q = mha._split(mha.w_q(x))
        k = mha._split(mha.w_k(x))
        z = (q @ k.transpose(-2, -1) / 8 ** 0.5).detach()        # (B, H, N, N)
        keep = mask.expand_as(z)
        rows = keep.any(-1)
        if name == "sigmoid":
            p = torch.where(keep, torch.sigmoid(z - torch.log(keep.sum(-1, keepdim=True)
                                                              .clamp(min=1).double())), 0.0)
            mass = p.sum(-1)
        elif name == "sink":
            e = torch.where(keep, torch.exp(z), 0.0)
            b = mha.mechanism.b.detach().view(1, 2, 1)
            mass = e.sum(-1) / (e.sum(-1) + torch.exp(b))
        else:
            mass = rows.double()
        want = (mass * rows).sum((0, 2)) / rows.sum((0, 2))
        assert_close(torch.tensor([r["mass_mean"] for r in records], dtype=torch.float64), want)
        sink = torch.tensor([r["sink_mass_mean"] for r in records], dtype=torch.float64)
        assert_close(sink, 1 - want if name == "sink" else torch.zeros(2, dtype=torch.float64))


def test_bare_gated_mechanism_is_scaled():
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    assert_close(build_mechanism("gated", 4, 2)(q, k, v), build_mechanism("scaled", 4, 2)(q, k, v))
