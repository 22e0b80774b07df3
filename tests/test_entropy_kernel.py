"""The compiled row-entropy kernel (attnscale.kernels.native.row_entropy, adaptive temperature's
statistics pass) against float64 softmax, on both builds (AVX2 and the portable 128-bit one).

The kernel leaves the top key out of its float sums and forms H = log1p(ties - 1 + S') + |T| /
(ties + S') from sums of same-signed terms, so its error is relative, as for the row-statistics
kernel (tests/test_rowstats.py derives the bound RTOL = 1e-5 for these float32 runs of 512 keys).
The log-sum-exp is z_t + log1p(...), with z_t exact: its part above the top logit is compared
with the same relative tolerance, plus the few ulp of |z_t| that one float64 sum can hold.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from attnscale import stats
from attnscale.kernels import native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="attnscale's compiled kernels are not built or disabled")

RTOL = 1e-5   # as in tests/test_rowstats.py: float32 runs of <= 128 terms per lane
WIDTHS = (1, 2, 3, 7, 8, 9, 511, 513, 1025, 2051)
ISA = pytest.mark.parametrize("portable", [False, True, native.AVX2], ids=["native", "portable", "avx2"])


def reference(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(H, lse - top, top) in float64 over the finite keys of z, 0 for keyless rows: H from
    attnscale.stats (exact near one-hot), lse - top = log1p of the sum over every key but one top
    (a float64 1 + e^-50 would round to 1)."""
    zd = z.double()
    top = zd.amax(dim=-1, keepdim=True)
    keyless = torch.isneginf(top).squeeze(-1)
    rest = torch.where(keyless.unsqueeze(-1), -math.inf, zd - top)
    rest = rest.scatter(-1, zd.argmax(dim=-1, keepdim=True), -math.inf)   # drop one top key
    above = torch.log1p(rest.exp().sum(dim=-1))
    ent = stats.softmax_stats(torch.where(keyless.unsqueeze(-1), 0.0, zd))["entropy"]
    zero = torch.zeros_like(above)
    return (torch.where(keyless, zero, ent), torch.where(keyless, zero, above),
            torch.where(keyless, zero, top.squeeze(-1)))


def check(z: torch.Tensor, portable: bool) -> None:
    got = native.row_entropy(z, portable=portable)
    assert got.dtype == torch.float64 and got.shape == (*z.shape[:-1], 2)
    ent, above, top = reference(z)
    assert torch.isfinite(got).all()
    assert_close(got[..., 0], ent, rtol=RTOL, atol=0.0)
    # lse = z_t + log1p(...) is one float64: the part above z_t is known to a few ulp of |z_t|
    lse_atol = 4 * 2.0**-53 * float(top.abs().max()) if top.numel() else 0.0
    assert_close(got[..., 1] - top, above, rtol=RTOL, atol=lse_atol)


@ISA
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("spread", [0.1, 3.0, 30.0])
def test_random_rows_match_float64_softmax(width, spread, portable):
    g = torch.Generator().manual_seed(width)
    z = torch.randn(6, width, generator=g) * spread
    check(z, portable)


@ISA
def test_masked_keys_ties_and_near_one_hot_rows(portable):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 600, generator=g)
    z[0, ::3] = -math.inf                     # masked keys
    z[1] = 2.5                                # all tied: H = ln n
    z[2, 10], z[2, 400] = 40.0, 40.0          # two tied tops far above the rest
    z[3, 7] = 60.0                            # one-hot to within e^-60: H ~ 1e-24, kept
    z[4, 599] = 1e30                          # the rest underflows: H = 0 exactly
    check(z, portable)
    got = native.row_entropy(z, portable=portable)
    assert_close(got[1, 0].item(), math.log(600), rtol=RTOL, atol=0.0)
    assert 0.0 < got[3, 0].item() < 1e-20
    assert got[4, 0].item() == 0.0


@ISA
def test_keyless_rows_give_zero_and_nan_or_inf_rows_give_nan(portable):
    z = torch.randn(4, 33)
    z[0] = -math.inf
    z[1, 5] = math.nan
    z[2, 32] = math.inf
    got = native.row_entropy(z, portable=portable)
    assert got[0].tolist() == [0.0, 0.0]
    assert torch.isnan(got[1]).all() and torch.isnan(got[2]).all()
    check(z[3:], portable)


@ISA
def test_limit_hides_the_keys_beyond_each_rows_count(portable):
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 3, 40, generator=g) * 4
    limit = torch.tensor([0, 1, 17], dtype=torch.int64)   # per query row, repeating per head
    got = native.row_entropy(z, limit=limit, portable=portable)
    hidden = z.clone()
    keys = limit.repeat(2).view(2, 3, 1)
    hidden[torch.arange(40) >= keys] = -math.inf
    assert_close(got, native.row_entropy(hidden, portable=portable), rtol=0.0, atol=0.0)
    check(hidden, portable)


def test_strided_rows_and_bad_input():
    z = torch.randn(4, 64)[:, :50]            # rows of stride 64
    assert_close(native.row_entropy(z), native.row_entropy(z.contiguous()), rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="z must be float32"):
        native.row_entropy(z.double())
    assert native.row_entropy(torch.empty(3, 0)).tolist() == [[0.0, 0.0]] * 3
