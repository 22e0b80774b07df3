"""The compiled row-statistics kernel (attnscale.kernels.rowstats) against the float64 formulation of
attnscale.stats, on each of its builds (AVX-512, AVX2 and the portable 128-bit one).

The reference evaluates attnscale.stats on the float32 logits upcast to float64 (exactly), so the
only difference it sees is the kernel's own arithmetic.  The kernel sums in float32 within runs of
512 keys, split over W = 16 (AVX-512), 8 (AVX2) or 4 (128-bit) lanes, i.e. at most 128 additions
per lane before the sum goes to float64.  Recursive summation of non-negative terms is accurate to (k - 1) * 2^-24
relative for k terms, so at most 127 * 6e-8 = 7.6e-6 (about 1e-6 for random rounding), and its
exp is within ~2 ulp (1.2e-7): RTOL = 1e-5 bounds the worst case.  Every sum the kernel forms is of
terms of one sign (entropy = log1p(S) + |p_t m sum u d|), so the error stays *relative* even where
a statistic is e^-100 small; hence ATOL = 0 for the softmax statistics.  count and logit_absmax are
exact (an integer, and a float32 value converted to float64) and are compared with zero tolerance.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.testing import assert_close

from attnscale import stats
from attnscale.kernels import native, rowstats

COLUMNS = ("count", "max_weight", "entropy", "jacobian_fro", "logit_std", "logit_absmax",
           "logit_max")
EXACT = ("count", "logit_absmax", "logit_max")
WIDTH = len(COLUMNS)
RTOL = 1e-5   # float32 blocks of <= 128 terms per lane (see the module docstring)
ATOL = 0.0    # all errors are relative: the statistics are sums of same-signed terms
# 1 - max_weight is formed here in float64 from p_t close to 1: rounding p_t costs up to 1 ulp
# of 1.0 on either side (2 * 2^-53), so 1 - p_t is only known to ~4 * 2^-53 absolutely.
ONE_MINUS_ATOL = 4 * 2.0**-53

# Every test here runs the compiled kernel: where it is not built (no C compiler at install time,
# or ATTNSCALE_NATIVE=0) the module is reported skipped with this reason; the PyTorch formulation
# callers use instead is tested in test_stats.py and, for the monitor, through the backend fixture.
pytestmark = pytest.mark.skipif(not native.available(),
                                reason="attnscale's compiled kernels are not built or disabled")

WIDTHS = (1, 2, 3, 7, 8, 9, 511, 513, 1025, 2051)
ISA = pytest.mark.parametrize("portable", [False, True, native.AVX2], ids=["native", "portable", "avx2"])


# ---------------------------------------------------------------------------------------------
# Reference and comparison


def reference(z: torch.Tensor) -> torch.Tensor:
    """The columns from attnscale.stats in float64; rows without a valid key are all 0."""
    zd = z.double()
    valid = torch.isfinite(zd)
    s = stats.softmax_stats(zd)
    absmax = torch.where(valid, zd.abs(), torch.zeros_like(zd)).amax(dim=-1)
    top = torch.where(valid, zd, -math.inf).amax(dim=-1)  # signed max over valid keys
    out = torch.stack([valid.sum(dim=-1).double(), s["max_weight"], s["entropy"],
                       s["jacobian_fro"], stats.logit_std(zd), absmax, top], dim=-1)
    return torch.where(valid.any(dim=-1, keepdim=True), out, torch.zeros_like(out))


def masked_by_limit(z: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``z`` with every column at or beyond ``clamp(limit[r % P], 0, n)`` of flat row r set to -inf."""
    n = z.shape[-1]
    flat = z.reshape(-1, n).clone()
    rows = torch.arange(flat.shape[0])
    keys = limit[rows % limit.numel()].clamp(0, n)
    flat[torch.arange(n) >= keys.unsqueeze(-1)] = -math.inf
    return flat.reshape(z.shape)


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, *, rtol: float = RTOL,
                      atol: float = ATOL) -> None:
    """Column by column, count and logit_absmax exactly; never NaN or inf."""
    assert got.dtype == torch.float64
    assert got.shape == want.shape
    assert torch.isfinite(got).all(), got
    for i, name in enumerate(COLUMNS):
        exact = name in EXACT
        assert_close(got[..., i], want[..., i], rtol=0.0 if exact else rtol,
                     atol=0.0 if exact else atol, msg=lambda m, name=name: f"{name}: {m}")


def randn(*shape: int, seed: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * std + mean


# ---------------------------------------------------------------------------------------------
# Build


def test_kernel_is_built():
    """CI builds the extension; this fails if it silently was not."""
    assert native.available()
    assert native.isa() in ("avx512", "avx2", "v128")
    assert native.ROW_STATS_COLUMNS == COLUMNS


# ---------------------------------------------------------------------------------------------
# 1. Random logits


@ISA
@pytest.mark.parametrize("mean, std", [(0.0, 0.1), (0.0, 1.0), (0.0, 5.0), (0.0, 30.0),
                                       (1000.0, 0.1)])
@pytest.mark.parametrize("n", WIDTHS)
def test_random_logits_match_float64_reference(n, mean, std, portable):
    # (1000, 0.1): a large common offset, where a one-pass variance would cancel.
    z = randn(6, n, seed=1000 * n + int(std * 10) + int(mean), std=std, mean=mean)
    got = rowstats.row_stats(z, portable=portable)
    assert_rows_close(got, reference(z))
    assert_close(got[:, 0], torch.full((6,), float(n), dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("cap", ["avx2", "v128", "bogus"])
def test_isa_env_caps_every_call(cap):
    """ATTNSCALE_ISA runs a narrower build on a wider CPU (to time what an older CPU runs)."""
    import subprocess
    import sys

    code = ("from attnscale.kernels import native\n"
            "print(native.isa(), native.cpu_bf16())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          env={**os.environ, native.ISA_ENV: cap})
    if cap == "bogus":
        assert done.returncode != 0 and f"{native.ISA_ENV} must be one of" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    levels = native.ISA_LEVELS
    want = min(levels[cap], levels[native.isa()])  # never above what this CPU runs
    assert done.stdout.split() == [next(k for k, v in levels.items() if v == want), "False"]


def test_portable_runs_the_other_build():
    """Each ``portable`` value runs its own build where the CPU has a wider one: float32 partial
    sums taken over other lane counts differ in the last bits somewhere on wide random rows.
    (Guards the parametrised tests against silently testing one build twice.)"""
    z = randn(16, 2051, seed=17, std=3.0)
    best = rowstats.row_stats(z)
    portable = rowstats.row_stats(z, portable=True)
    avx2 = rowstats.row_stats(z, portable=native.AVX2)
    # A build the CPU lacks falls back to the next one down, which then agrees bit for bit.
    assert torch.equal(best, portable) == (native.isa() == "v128")
    assert torch.equal(best, avx2) == (native.isa() != "avx512")
    assert torch.equal(avx2, portable) == (native.isa() == "v128")
    assert_rows_close(portable, best)
    assert_rows_close(avx2, best)


# ---------------------------------------------------------------------------------------------
# 2. Near one-hot


@ISA
# 27 and 28 straddle the gap (2^-40 = e^-27.7) past which the kernel's second pass is taken
# again from the largest logit below the top instead of from the top
@pytest.mark.parametrize("gap", [10.0, 27.0, 28.0, 50.0, 100.0, 1e3, 1e4])
@pytest.mark.parametrize("n, top", [(2, 1), (9, 0), (700, 37), (1025, 1024), (1025, 600)],
                         ids=lambda v: str(v))
def test_near_one_hot_is_relatively_accurate(n, top, gap, portable):
    z = randn(3, n, seed=int(gap) + n + top)
    z[:, top] = z.max(dim=-1).values + gap
    got, want = rowstats.row_stats(z, portable=portable), reference(z)
    assert not torch.isnan(got).any()
    assert (got >= 0).all()
    # ATOL = 0: at gap 100 the entropy is ~1e-40 and ||J|| ~1e-42, and must still match.
    assert_rows_close(got, want)
    mw = got[:, 1]
    assert (mw <= 1).all()
    assert_close(1 - mw, 1 - want[:, 1], rtol=RTOL, atol=ONE_MINUS_ATOL)
    if gap <= 100:  # S >= e^-100 * (n - 1): still representable, so nothing is flushed to 0
        assert (got[:, 2] > 0).all() and (got[:, 3] > 0).all()


def test_near_one_hot_values_at_gap_100():
    """Closed form for [g, 0]: p_2 = e^-g / (1 + e^-g), H = p_2 (1 + g) + O(p_2^2),
    ||J|| = 2 p_1 p_2 (the 2 x 2 Jacobian is p_1 p_2 [[1, -1], [-1, 1]])."""
    g = 100.0
    z = torch.tensor([[g, 0.0]])
    got = rowstats.row_stats(z)[0]
    p2 = math.exp(-g) / (1 + math.exp(-g))
    want = torch.tensor([2.0, 1.0 - p2, -(1 - p2) * math.log1p(-p2) - p2 * math.log(p2),
                         2 * (1 - p2) * p2, g / math.sqrt(2), g, g], dtype=torch.float64)
    assert_close(got, want, rtol=RTOL, atol=0.0)


# ---------------------------------------------------------------------------------------------
# 3. Ties


@ISA
@pytest.mark.parametrize("value", [0.0, -5.5, 17.25])
@pytest.mark.parametrize("n", [2, 3, 7, 8, 9, 511, 513, 1025])
def test_all_equal_row_is_uniform(n, value, portable):
    z = torch.full((2, n), value)
    got = rowstats.row_stats(z, portable=portable)
    # Uniform p = 1/n: H = ln n, ||J||^2 = n (1/n)^2 (1 - 1/n)^2 + n (n - 1) / n^4 = (n - 1) / n^2.
    want = torch.tensor([n, 1.0 / n, math.log(n), math.sqrt(n - 1) / n, 0.0, abs(value),
                         value], dtype=torch.float64).expand(2, WIDTH)
    assert_rows_close(got, want, rtol=RTOL, atol=1e-12)  # std: 0 up to rounding of the mean
    assert_rows_close(got, reference(z), rtol=RTOL, atol=1e-12)


@ISA
@pytest.mark.parametrize("n, tops", [(2, (0, 1)), (9, (0, 8)), (9, (3, 4)), (513, (5, 512)),
                                     (1025, (0, 1024)), (1025, (100, 700))],
                         ids=lambda v: str(v))
def test_two_way_tie_at_the_top(n, tops, portable):
    # Alone (weight 1/2 each, H = ln 2, ||J|| = 1/2) and above random smaller keys.
    alone = torch.full((1, n), -math.inf)
    alone[0, list(tops)] = 3.0
    got = rowstats.row_stats(alone, portable=portable)
    want = torch.tensor([[2.0, 0.5, math.log(2), 0.5, 0.0, 3.0, 3.0]], dtype=torch.float64)
    assert_rows_close(got, want)
    z = randn(4, n, seed=n + tops[1], std=2.0)
    z[:, list(tops)] = z.max(dim=-1, keepdim=True).values + 0.5
    got = rowstats.row_stats(z, portable=portable)
    assert_rows_close(got, reference(z))
    assert (got[:, 1] < 0.5).all() or n == 2


@ISA
@pytest.mark.parametrize("gap", [0.25, 3.0, 100.0])
@pytest.mark.parametrize("n, k", [(7, 3), (9, 4), (513, 3), (2051, 5), (2051, 17)])
def test_ties_at_the_top_plus_smaller_keys(n, k, gap, portable):
    """k keys tie at the top, spread over lanes and 512-key runs, the rest lie below by >= gap."""
    z = randn(3, n, seed=n * k + int(gap), std=1.0)
    z = z - z.max(dim=-1, keepdim=True).values - gap          # all <= -gap
    tops = torch.linspace(0, n - 1, k).round().long()
    z[:, tops] = 0.0
    got = rowstats.row_stats(z, portable=portable)
    assert_rows_close(got, reference(z))
    # p_top = 1 / (k + sum_rest e^z): independent of the top-key decomposition.
    rest = torch.where(z < 0, z.double().exp(), torch.zeros((), dtype=torch.float64)).sum(-1)
    assert_close(got[:, 1], 1.0 / (k + rest), rtol=RTOL, atol=0.0)
    if gap >= 100:  # the rest weigh ~e^-100: k-way uniform to float64 precision
        assert_close(got[:, 2], torch.full((3,), math.log(k), dtype=torch.float64),
                     rtol=1e-12, atol=0.0)


# ---------------------------------------------------------------------------------------------
# 4. Masks and limits


@ISA
@pytest.mark.parametrize("n", [3, 8, 9, 511, 513, 1025, 2051])
def test_masked_keys_anywhere(n, portable):
    z = randn(8, n, seed=n, std=3.0)
    top = torch.tensor([min(i * (n // 7), n - 1) for i in range(8)])
    z[torch.arange(8), top] = 50.0
    z[:, 0] = -math.inf                                       # first and last positions
    z[:, -1] = -math.inf
    z[torch.arange(8), (top - 1).clamp(min=0)] = -math.inf    # the top's neighbours
    z[torch.arange(8), (top + 1).clamp(max=n - 1)] = -math.inf
    g = torch.Generator().manual_seed(n + 1)
    z[torch.rand(8, n, generator=g) < 0.3] = -math.inf        # and random others
    z[torch.arange(8), top] = 50.0 - torch.arange(8).float()  # keep the top (n = 3: alone)
    got = rowstats.row_stats(z, portable=portable)
    assert_rows_close(got, reference(z))
    assert_close(got[:, 0], torch.isfinite(z).sum(-1).double(), rtol=0, atol=0)


@ISA
@pytest.mark.parametrize("n", [1, 2, 7, 9, 513, 1025])
def test_one_valid_key(n, portable):
    positions = sorted({0, n // 2, n - 1})
    z = torch.full((len(positions), n), -math.inf)
    values = torch.tensor([-7.5, 0.0, 123.0])[:len(positions)]
    z[torch.arange(len(positions)), positions] = values
    got = rowstats.row_stats(z, portable=portable)
    want = torch.zeros(len(positions), WIDTH, dtype=torch.float64)
    want[:, 0], want[:, 1], want[:, 5] = 1.0, 1.0, values.abs().double()
    want[:, 6] = values.double()
    assert_close(got, want, rtol=0, atol=0)
    assert_rows_close(got, reference(z))


@ISA
@pytest.mark.parametrize("n", [1, 4, 9, 513, 1025])
def test_fully_masked_rows_are_zero(n, portable):
    z = randn(4, n, seed=n)
    z[1] = -math.inf
    z[3] = -math.inf
    got = rowstats.row_stats(z, portable=portable)
    assert_close(got[[1, 3]], torch.zeros(2, WIDTH, dtype=torch.float64), rtol=0, atol=0)
    assert_rows_close(got, reference(z))
    assert (got[[0, 2], 0] == n).all()


@ISA
@pytest.mark.parametrize("n", [1, 9, 600])
@pytest.mark.parametrize("limit", ["causal", "causal0", "mixed", "beyond"])
def test_limit_matches_explicit_masking(n, limit, portable):
    B, H, P = 2, 3, 7
    z = randn(B, H, P, n, seed=n + len(limit), std=2.0)
    limits = {
        "causal": torch.arange(1, P + 1) + (n - P if n > P else 0),   # last query sees all
        "causal0": torch.arange(P) - 2,                                # first rows see nothing
        "mixed": torch.tensor([0, -1, -(2**40), n, n + 1, 2**40, n // 2]),
        "beyond": torch.full((P,), n + 3),
    }[limit].to(torch.int64)
    got = rowstats.row_stats(z, limit=limits, portable=portable)
    masked = masked_by_limit(z, limits)
    # The same arithmetic as on the masked logits: masked keys only ever add exact zeros.
    assert_close(got, rowstats.row_stats(masked, portable=portable), rtol=1e-12, atol=0.0)
    assert_rows_close(got, reference(masked))
    keys = limits.clamp(0, n).double().expand(B, H, P)
    assert_close(got[..., 0], keys, rtol=0, atol=0)


def test_limit_period_wraps_over_flattened_rows():
    """Row r uses limit[r % P] even when P does not divide the number of rows."""
    z = randn(11, 20, seed=5)
    limits = torch.tensor([3, 20, 0], dtype=torch.int64)
    got = rowstats.row_stats(z, limit=limits)
    assert_close(got[:, 0], torch.tensor([3.0, 20, 0] * 3 + [3.0, 20], dtype=torch.float64),
                 rtol=0, atol=0)
    assert_rows_close(got, reference(masked_by_limit(z, limits)))


# ---------------------------------------------------------------------------------------------
# 5. Threads


@ISA
def test_threads_are_bit_identical(portable):
    z = randn(131, 1025, seed=7, std=4.0)
    z[::5, 3] = -math.inf
    limits = torch.arange(131, dtype=torch.int64) * 9
    assert z.numel() > rowstats.PARALLEL_MIN_ELEMENTS
    for lim in (None, limits):
        base = rowstats.row_stats(z, limit=lim, portable=portable, threads=1)
        for threads in (2, 3, None):
            other = rowstats.row_stats(z, limit=lim, portable=portable, threads=threads)
            assert torch.equal(base, other), threads
    assert_rows_close(base, reference(masked_by_limit(z, limits)))


# ---------------------------------------------------------------------------------------------
# 6. Shapes and strides


@ISA
@pytest.mark.parametrize("n", [1, 9, 513])
def test_four_dim_input_equals_flattened_call(n, portable):
    z = randn(2, 3, 5, n, seed=n)
    got = rowstats.row_stats(z, portable=portable)
    assert got.shape == (2, 3, 5, WIDTH)
    flat = rowstats.row_stats(z.reshape(-1, n), portable=portable)
    assert torch.equal(got, flat.reshape(2, 3, 5, WIDTH))
    assert_rows_close(got, reference(z))


def _views() -> dict[str, torch.Tensor]:
    big = randn(2, 3, 40, 30, seed=11)
    return {
        "transposed": big.transpose(-1, -2),               # last stride 30
        "sliced_cols": big[..., 3:20],                     # row stride 30 > n
        "every_other_col": big[..., ::2],                  # last stride 2, row stride 30 > n
        "one_row_strided": big[1, 2, 7, 1::3],             # one row, last stride 3
        "strided_rows": big[:, :, ::3],                    # row stride 90
        "permuted": big.permute(2, 0, 1, 3),               # rows not uniformly strided
        "one_row": big[0, 0, 4:5, 2:29],
        "one_col": big[..., 7:8],                           # n = 1, row stride 30
        "expanded": big[0, 0, :1].expand(6, 30),           # row stride 0
        "sliding": big.flatten()[5:].as_strided((12, 20), (3, 1)),  # overlapping rows
    }


@ISA
@pytest.mark.parametrize("name", list(_views()))
def test_non_contiguous_equals_contiguous(name, portable):
    z = _views()[name]
    got = rowstats.row_stats(z, portable=portable)
    assert got.shape == (*z.shape[:-1], WIDTH)
    assert torch.equal(got, rowstats.row_stats(z.contiguous(), portable=portable))
    assert_rows_close(got, reference(z))


def test_single_row_and_grad_input():
    z = randn(9, seed=3).requires_grad_()
    got = rowstats.row_stats(z)
    assert got.shape == (WIDTH,)
    assert_rows_close(got, reference(z.detach()))


@pytest.mark.parametrize("row", [[1e20, -1e20, 0.0], [-1e30, 0.0], [3e38, 3e38, 1.0],
                                 [1e-40, 2e-40, 0.0], [1e-30, 1e-30, 3e-30]],
                         ids=["1e20", "1e30", "near-FLT_MAX", "denormal", "tiny"])
@ISA
def test_extreme_magnitudes_keep_std_and_absmax(row, portable):
    # Squares of deviations are taken in units of a power of two near max |z|: no overflow at
    # 1e20 (where z^2 leaves float32) and no loss at denormal scale.
    z = torch.tensor([row], dtype=torch.float32)
    got = rowstats.row_stats(z, portable=portable)
    want = reference(z)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:, 4:], want[:, 4:], rtol=1e-5, atol=0)


@ISA
def test_opposite_logits_near_float_max_give_a_finite_entropy(portable):
    # z_i - z_t = -6e38 overflows float32; the weight of that key is 0 either way.
    got = rowstats.row_stats(torch.tensor([[3e38, -3e38]]), portable=portable)
    assert got[0, :4].tolist() == [2.0, 1.0, 0.0, 0.0]


@ISA
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_plus_inf_logits_give_nan_statistics(bad, portable):
    z = torch.tensor([[1.0, bad, 2.0, -math.inf], [1.0, 2.0, 3.0, 4.0]])
    got = rowstats.row_stats(z, portable=portable)
    assert got[0, 0].item() == 3.0                  # the bad logit counts as a key
    assert torch.isnan(got[0, 1:]).all()
    assert_rows_close(got[1:], reference(z[1:]))


@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (2, 0, 4)])
def test_empty_inputs(shape):
    got = rowstats.row_stats(torch.zeros(shape))
    assert got.shape == (*shape[:-1], WIDTH)
    assert torch.equal(got, torch.zeros_like(got))


# ---------------------------------------------------------------------------------------------
# 7. Errors and the disabled kernel


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_non_float32_logits_raise(dtype):
    with pytest.raises(ValueError, match=r"\bz\b"):
        rowstats.row_stats(torch.zeros(2, 5, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_non_int64_limit_raises(dtype):
    with pytest.raises(ValueError, match=r"\blimit\b"):
        rowstats.row_stats(torch.zeros(2, 5), limit=torch.ones(2, dtype=dtype))


def test_empty_limit_raises():
    with pytest.raises(ValueError, match=r"\blimit\b"):
        rowstats.row_stats(torch.zeros(2, 5), limit=torch.zeros(0, dtype=torch.int64))


def test_disabled_kernel(monkeypatch):
    try:
        with monkeypatch.context() as m:
            m.setenv(native.NATIVE_ENV, "0")
            native.library.cache_clear()
            assert not native.available()
            assert native.isa() is None
            with pytest.raises(RuntimeError, match=native.NATIVE_ENV):
                rowstats.row_stats(torch.zeros(2, 5))
    finally:
        native.library.cache_clear()  # the environment is restored: load the kernel again
    assert native.available()


def test_worker_pool_in_a_forked_child():
    # A child forked after the parent used the pool must get working threads of its own.
    import multiprocessing as mp

    z = randn(64, 2048, seed=5)
    want = rowstats.row_stats(z, threads=2)          # the parent's pool now has threads
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as child:
        got = child.apply_async(rowstats.row_stats, (z,), {"threads": 2}).get(timeout=20)
    assert torch.equal(got, want)


@pytest.mark.parametrize("threads", [0, -2])
def test_threads_below_one_raise(threads):
    with pytest.raises(ValueError, match="threads"):
        rowstats.row_stats(torch.zeros(2, 5), threads=threads)
