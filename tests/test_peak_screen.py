"""The bfloat16 screen of attnscale.kernels.peak.head_peaks: the float32 answer from a bfloat16
q kᵀ plus an exact second pass over the candidate rows, and the bfloat16 row-max kernel."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from attnscale.kernels import native, peak

# Two float32 computations of one logit (different summation orders) differ by at most 2 γ_d of
# Σ|q_j k_j|; with these inputs' magnitudes that stays within a few float32 ulp of the maximum.
ULP_RTOL = 8 * 2.0**-24


@pytest.fixture
def screened(monkeypatch):
    """Counts the calls the screen answered (None: it handed the call to the one-pass path)."""
    answered = []
    original = peak._screened

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        answered.append(out is not None)
        return out
    monkeypatch.setattr(peak, "_screened", spy)
    return answered


def reference(q, k, scale, keep):
    z = q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)
    z = z * (scale.double() if isinstance(scale, torch.Tensor) else scale)
    return z.masked_fill(~keep, -math.inf).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool"])
@pytest.mark.parametrize("scale", ["float", "per-head", "per-row"])
@pytest.mark.parametrize("rows", [1 << 22, 3000])
def test_screen_gives_the_float32_maximum(causal, mask, scale, rows, screened):
    g = torch.Generator().manual_seed(3)
    n = 96
    q, k = torch.randn(2, 4, n, 16, generator=g) * 2, torch.randn(2, 2, n, 16, generator=g)
    s = {"float": 0.25, "per-head": torch.rand(1, 4, 1, 1, generator=g) + 0.1,
         "per-row": torch.rand(2, 4, n, 1, generator=g)}[scale]
    keep = torch.ones(n, n, dtype=torch.bool)
    given = None
    if mask is not None:
        keep = torch.rand(2, 1, n, n, generator=g) > 0.3
        keep[1, 0, 7] = False                     # a query with no key
        given = keep
    if causal:
        keep = keep & torch.ones(n, n, dtype=torch.bool).tril()
    got = peak.head_peaks(q, k, s, mask=given, causal=causal, block_elements=rows, screen=True)
    assert screened == [True]
    one_pass = peak.head_peaks(q, k, s, mask=given, causal=causal, block_elements=rows,
                               screen=False)
    assert_close(got, one_pass, rtol=ULP_RTOL, atol=0.0)
    assert_close(got, reference(q, k, s, keep), rtol=1e-5, atol=1e-6)


def test_screen_keeps_a_maximum_that_bfloat16_rounding_would_lose(screened):
    # Rows 0..11 of each head share one top logit up to 1e-5 relative, far below bfloat16's
    # resolution (2^-8): the bfloat16 pass cannot rank them, and the exact pass must.
    g = torch.Generator().manual_seed(4)
    d, n = 32, 256
    k = torch.randn(1, 2, n, d, generator=g)
    q = torch.randn(1, 2, n, d, generator=g) * 0.01
    base = k[:, :, :1] / k[:, :, :1].norm(dim=-1, keepdim=True) * 5.0
    q[:, :, :12] = base * (1 + 1e-5 * torch.randn(1, 2, 12, 1, generator=g))
    got = peak.head_peaks(q, k, 1.0, screen=True)
    assert screened == [True]
    assert_close(got, peak.head_peaks(q, k, 1.0, screen=False), rtol=ULP_RTOL, atol=0.0)
    assert_close(got, reference(q, k, 1.0, torch.ones(n, n, dtype=torch.bool)), rtol=1e-6,
                 atol=0.0)


def test_screen_error_bound_holds_for_every_logit():
    g = torch.Generator().manual_seed(5)
    for d, spread in ((8, 1.0), (64, 30.0), (128, 1e-3)):
        q, k = torch.randn(3, 200, d, generator=g) * spread, torch.randn(3, 300, d, generator=g)
        z32 = q @ k.transpose(1, 2)
        zbf = (q.bfloat16() @ k.bfloat16().transpose(1, 2)).double()
        bound = peak.screen_bound(d) * q.double().norm(dim=-1, keepdim=True) \
            * k.double().norm(dim=-1).unsqueeze(1)
        excess = ((zbf - z32.double()).abs() - bound).max().item()
        assert excess <= 0.0, (d, spread, excess)


@pytest.mark.parametrize("case", ["negative-scale", "nan", "inf", "additive-bias", "ties"])
def test_screen_hands_what_it_cannot_bound_to_the_one_pass_path(case, screened):
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(1, 2, 64, 8, generator=g), torch.randn(1, 2, 64, 8, generator=g)
    scale, mask = 0.5, None
    if case == "negative-scale":
        scale = -0.5
    elif case == "nan":
        q[0, 1, 3, 2] = math.nan
    elif case == "inf":
        k[0, 0, 9, 1] = math.inf
    elif case == "additive-bias":
        mask = torch.randn(1, 1, 64, 64, generator=g)
    else:  # every query the same: all 64 rows are candidates, over 1/16 of them
        q[:] = q[:, :, :1]
    got = peak.head_peaks(q, k, scale, mask=mask, screen=True)
    want = peak.head_peaks(q, k, scale, mask=mask, screen=False)
    assert_close(got, want, rtol=0.0, atol=0.0, equal_nan=True)
    if case == "additive-bias":
        assert screened == []        # biases never reach the screen
    else:
        assert screened == [False]
    if case == "nan":
        assert torch.isnan(got[1]) and torch.isfinite(got[0])


def test_automatic_mode_screens_large_calls_only_where_bfloat16_is_fast(screened, monkeypatch):
    q, k = torch.randn(1, 1, 1024, 8), torch.randn(1, 1, 1024, 8)
    monkeypatch.setattr(peak, "bf16_fast", lambda: False)
    peak.head_peaks(q, k, 1.0)
    assert screened == []
    monkeypatch.setattr(peak, "bf16_fast", lambda: True)
    peak.head_peaks(q[..., :8, :], k[..., :8, :], 1.0)       # 64 logits: below the threshold
    assert screened == []
    peak.head_peaks(q, k, 1.0)                       # 2^20 logits: the C loop is faster here
    assert screened == []
    peak.head_peaks(q, k, 1.0, mask=torch.ones(1024, 1024, dtype=torch.bool))
    assert screened == [True]                        # ... but a mask takes the Python pass
    monkeypatch.setattr(peak, "SCREEN_OVER_NATIVE_ELEMENTS", 1 << 20)
    peak.head_peaks(q, k, 1.0)
    assert screened == [True, True]


@pytest.mark.skipif(not native.available(), reason="attnscale's compiled kernels are not built")
@pytest.mark.parametrize("portable", [False, True, native.AVX2], ids=["native", "portable", "avx2"])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 33, 1024])
def test_bf16_row_max_kernel(width, portable):
    g = torch.Generator().manual_seed(width)
    z = (torch.randn(5, width + 3, generator=g) * 50).bfloat16()[:, :width]   # strided rows
    z[0] = -math.inf
    z[1, 0] = -math.inf
    got = native.bf16_row_max(z, portable=portable)
    assert got.dtype == torch.float32
    assert_close(got, z.float().amax(dim=-1), rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="z must be bfloat16"):
        native.bf16_row_max(z.float())


@pytest.mark.skipif(not native.available(), reason="attnscale's compiled kernels are not built")
def test_bfloat16_dot_products_count_as_fast_bfloat16(monkeypatch):
    """AVX512_BF16 (AMD Zen 4 and later) runs the screen as AMX does: the kernels read the flag
    as Linux reports it, and either flag turns the screen on."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("flags")), [])
        assert native.cpu_bf16() == ("avx512_bf16" in flags)
    monkeypatch.setattr(peak, "amx", lambda: False)
    monkeypatch.setattr(native, "cpu_bf16", lambda: True)
    assert peak.bf16_fast()
    monkeypatch.setattr(native, "cpu_bf16", lambda: False)
    assert not peak.bf16_fast()
