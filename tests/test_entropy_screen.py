"""The bfloat16 screen of adaptive temperature's entropy pass (attnscale.kernels.entropy): the
bfloat16 kernel against float64, the proven bound |H - H̃| <= ε e^ε (σ̃ + ε) on every row, and
adaptive-temp's outputs and gradients the same with the screen as without it.

The screen runs on any CPU (bfloat16 matmuls are only slower where neither AMX nor AVX512_BF16
is there); the tests force it with ``peak.bf16_fast``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from attnscale.kernels import entropy, native, peak
from attnscale.mechanisms import build_mechanism
from attnscale.mechanisms.adaptive_temp import BETA_WINDOW, needs_exact_entropy
from attnscale.workers import num_threads

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="attnscale's compiled kernels are not built or disabled")

ISA = pytest.mark.parametrize("portable", [False, True, native.AVX2],
                              ids=["native", "portable", "avx2"])


@ISA
@pytest.mark.parametrize("width", [1, 2, 31, 32, 33, 513, 1100])
def test_bf16_kernel_against_float64(width, portable):
    gen = torch.Generator().manual_seed(width)
    z = (3 * torch.randn(6, width, generator=gen)).bfloat16()
    z[1, width // 2:] = float("-inf")          # masked keys
    z[2] = float("-inf")                       # no key
    z[3, 0] = float("nan")
    limit = torch.tensor([width, width, width, width, max(1, width // 3), width])
    got = native.bf16_row_entropy(z, 0.5, limit=limit, portable=portable)
    zd = 0.5 * z.double()
    zd = zd.masked_fill(torch.arange(width) >= limit.view(-1, 1), float("-inf"))
    for r in (0, 1, 4, 5):
        if torch.isneginf(zd[r]).all():                  # width 1: row 1 has no key
            assert got[r].tolist() == [0.0, -math.inf, 0.0]
            continue
        p = torch.softmax(zd[r], -1)
        keep = p > 0
        h = -(p[keep] * p[keep].log()).sum()
        mean = (p[keep] * zd[r][keep]).sum()
        sd = (p[keep] * (zd[r][keep] - mean) ** 2).sum().sqrt()
        assert_close(got[r, 0], h, rtol=1e-5, atol=1e-6)
        assert got[r, 1] == zd[r].max()
        # an upper bound on σ, by at most the slack for the float sums
        assert sd - 1e-7 <= got[r, 2] <= sd * (1 + 1e-3) + 1e-2 * zd[r][keep].abs().max()
    assert got[2].tolist() == [0.0, -math.inf, 0.0]
    assert torch.isnan(got[3]).all()


@pytest.mark.parametrize("sharp", [0.3, 1.0, 4.0, 20.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_bound_holds_on_every_row(sharp, causal, monkeypatch):
    # Everything "needed" nowhere: every row keeps its screened H̃, which must lie within its
    # bound of the exact float32 entropy.
    monkeypatch.setattr(peak, "bf16_fast", lambda: True)
    monkeypatch.setattr(peak, "SCREEN_MIN_ELEMENTS", 0)
    gen = torch.Generator().manual_seed(int(sharp * 10) + causal)
    q = torch.randn(2, 3, 200, 32, generator=gen) * torch.linspace(0.05, sharp, 200).view(-1, 1)
    k = torch.randn(2, 3, 150, 32, generator=gen)
    bounds = {}

    def nowhere(lo, hi):
        bounds["lo"], bounds["hi"] = lo, hi
        return torch.zeros_like(lo, dtype=torch.bool)

    with num_threads(1):  # one worker: one call of exact_where sees every row, (B·H, Nq, 1)
        screened, _ = entropy.entropy_forward(q, k, None, causal, 0.2, exact_where=nowhere)
    exact, _ = entropy.entropy_forward(q, k, None, causal, 0.2)
    h = exact.double().flatten(0, 1)
    assert bounds["lo"].shape == h.shape
    assert (bounds["lo"] <= h).all() and (h <= bounds["hi"]).all()
    assert ((screened.double().flatten(0, 1) - bounds["lo"]) >= -1e-6).all()
    if sharp <= 1.0:  # logits of a few units: a bound of a few tenths, not a shrug
        assert ((bounds["hi"] - bounds["lo"]) < 1.0).all()


@pytest.mark.parametrize("sharp", [1.0, 3.0, 8.0])
@pytest.mark.parametrize("where", ["full", "causal", "mask"])
def test_adaptive_temp_is_the_same_with_the_screen(sharp, where, monkeypatch):
    monkeypatch.setattr(peak, "SCREEN_MIN_ELEMENTS", 0)
    gen = torch.Generator().manual_seed(int(sharp))
    q, k, v, g = (torch.randn(2, 4, 160, 32, generator=gen) for _ in range(4))
    q = q * torch.linspace(0.1, sharp, 160).view(-1, 1)   # rows across β's window
    mask = (torch.rand(2, 1, 160, 160, generator=gen) > 0.3) if where == "mask" else None
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mech = build_mechanism("adaptive-temp", 32, 4)
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(peak, "bf16_fast", lambda fast=fast: fast)
        out = mech(q, k, v, causal=where == "causal", mask=mask)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for a, b in zip(*runs):
        assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_screen_steps_aside_for_non_finite_input(monkeypatch):
    monkeypatch.setattr(peak, "bf16_fast", lambda: True)
    monkeypatch.setattr(peak, "SCREEN_MIN_ELEMENTS", 0)
    q, k = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    q[0, 1, 3, 2] = float("nan")
    seen = []
    original = entropy._screened
    monkeypatch.setattr(entropy, "_screened", lambda *a: seen.append(original(*a)) or seen[-1])
    ent, _ = entropy.entropy_forward(q, k, None, False, 0.25, exact_where=needs_exact_entropy)
    assert seen == [None]
    assert torch.isnan(ent[0, 1, 3]) and torch.isfinite(ent[0, 0]).all()


def test_beta_window_is_where_the_polynomial_exceeds_one():
    (lo, hi), = BETA_WINDOW
    from attnscale.mechanisms.adaptive_temp import beta
    h = torch.tensor([lo - 1e-6, lo + 1e-6, hi - 1e-6, hi + 1e-6, 0.5, 3.0], dtype=torch.float64)
    b = beta(h)
    assert b[0] == 1 and b[1] > 1 and b[2] > 1 and b[3] == 1 and b[4] == 1 and b[5] > 1
    need = needs_exact_entropy(torch.tensor([0.0, 6.0, 0.85, 5.0]),
                               torch.tensor([0.8, 6.5, 0.9, 7.0]))
    assert need.tolist() == [False, False, True, True]
