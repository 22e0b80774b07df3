"""Softmax statistics against independent references: float64 (materialised J) and mpmath.

References here never reuse the module's top-key decomposition: the float64 one builds
``J = diag(p) - p p^T`` explicitly, and the mpmath one (50 digits, unbounded exponent range) forms
``1 - p_i`` and ``sum_{j != i} p_j^2`` as sums of the *other* terms, so it has no cancellation.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from torch.testing import assert_close

import attnscale
from attnscale import stats
from attnscale.precision import upcast
from attnscale.stats import entropy, jacobian_fro, logit_std, max_weight, softmax_stats

STATS = ("max_weight", "entropy", "jacobian_fro", "logit_std")
FUNCS = {"max_weight": max_weight, "entropy": entropy, "jacobian_fro": jacobian_fro,
         "logit_std": logit_std}


def all_stats(z: torch.Tensor) -> dict[str, torch.Tensor]:
    """The four public functions, each called on its own."""
    return {name: fn(z) for name, fn in FUNCS.items()}


# ---------------------------------------------------------------------------------------------
# References


def ref_float64(z: torch.Tensor) -> dict[str, torch.Tensor]:
    """Textbook float64 reference over the last dim, materialising the n x n Jacobian."""
    z = z.double()
    p = torch.softmax(z, dim=-1)                                       # (..., n)
    jac = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)      # (..., n, n)
    return {
        "max_weight": p.max(dim=-1).values,
        "entropy": -(p * torch.log(p)).sum(dim=-1),
        "jacobian_fro": torch.linalg.matrix_norm(jac, ord="fro"),
        "logit_std": z.std(dim=-1),
    }


def _exclusive_sums(xs: list) -> list:
    """``[sum_{j != i} x_j for i]`` via prefix and suffix sums (no subtraction)."""
    n = len(xs)
    prefix, suffix = [mpmath.mpf(0)] * (n + 1), [mpmath.mpf(0)] * (n + 1)
    for i in range(n):
        prefix[i + 1] = prefix[i] + xs[i]
        suffix[n - 1 - i] = suffix[n - i] + xs[n - 1 - i]
    return [prefix[i] + suffix[i + 1] for i in range(n)]


def ref_mpmath(row: list[float]) -> dict[str, float]:
    """All four statistics of one row at 50 digits, rounded to float64; -inf keys excluded."""
    with mpmath.workdps(50):
        z = [mpmath.mpf(v) for v in row if v != -math.inf]
        n = len(z)
        if n == 0:
            return dict.fromkeys(STATS, 0.0)
        top = max(range(n), key=lambda i: z[i])
        d = [zi - z[top] for zi in z]                           # <= 0
        w = [mpmath.exp(di) for di in d]
        rest = mpmath.fsum(w[i] for i in range(n) if i != top)  # Z = 1 + rest
        p = [wi / (1 + rest) for wi in w]
        not_p = _exclusive_sums(p)                              # 1 - p_i without cancellation
        others2 = _exclusive_sums([pi * pi for pi in p])        # sum_{j != i} p_j^2
        # ||J||_F^2 = sum_i p_i^2 (1 - p_i)^2 + sum_i p_i^2 sum_{j != i} p_j^2
        jac2 = mpmath.fsum(pi * pi * (npi * npi + o2) for pi, npi, o2 in zip(p, not_p, others2))
        # -log p_i = log1p(rest) - d_i >= 0
        log_z = mpmath.log1p(rest)
        ent = mpmath.fsum(pi * (log_z - di) for pi, di in zip(p, d))
        if n >= 2:
            mean = mpmath.fsum(z) / n
            std = mpmath.sqrt(mpmath.fsum((zi - mean) ** 2 for zi in z) / (n - 1))
        else:
            std = mpmath.mpf(0)
        return {"max_weight": float(p[top]), "entropy": float(ent),
                "jacobian_fro": float(mpmath.sqrt(jac2)), "logit_std": float(std)}


def assert_rel(got: float, ref: float, what: str, rel: float = 1e-6) -> None:
    """Finite and within ``rel`` of ``ref``; where ``ref`` underflowed, within 1e-300 of it."""
    assert math.isfinite(got), f"{what}: got {got}"
    assert abs(got - ref) <= rel * abs(ref) + 1e-300, f"{what}: got {got!r}, reference {ref!r}"


def check_against_mpmath(z: torch.Tensor, label: str) -> None:
    """Every statistic of every row of ``z`` (float64) against the mpmath reference."""
    got = all_stats(z)
    rows = z.reshape(-1, z.shape[-1])
    for r in range(rows.shape[0]):
        ref = ref_mpmath(rows[r].tolist())
        for name in STATS:
            assert_rel(float(got[name].reshape(-1)[r]), ref[name], f"{label} row {r} {name}")


# ---------------------------------------------------------------------------------------------
# Moderate logits: float64 reference with the Jacobian materialised


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 17), (2, 1, 4, 33)])
@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_each_statistic_matches_float64_reference(shape, scale):
    gen = torch.Generator().manual_seed(len(shape) * 100 + int(scale * 10))
    z = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    got, ref = all_stats(z), ref_float64(z)
    for name in STATS:
        assert got[name].shape == shape[:-1], name
        assert got[name].dtype == torch.float64, name
        assert_close(got[name], ref[name], rtol=1e-10, atol=1e-14, msg=name)


def test_float32_matches_float64_reference():
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(6, 40, generator=gen) * 4
    got, ref = all_stats(z), ref_float64(z)
    for name in STATS:
        assert got[name].dtype == torch.float32, name
        assert_close(got[name].double(), ref[name], rtol=2e-5, atol=1e-6, msg=name)


def test_softmax_stats_agrees_with_single_functions():
    z = torch.randn(5, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 5
    together = softmax_stats(z)
    assert set(together) == {"max_weight", "entropy", "jacobian_fro"}
    for name, value in together.items():
        assert_close(value, FUNCS[name](z), rtol=0, atol=0, msg=name)


def test_public_api_exports_the_statistics():
    for name in ("max_weight", "entropy", "jacobian_fro", "logit_std", "softmax_stats",
                 "row_stats"):
        assert getattr(attnscale, name) is getattr(stats, name)
        assert name in attnscale.__all__


def test_integer_logits_are_rejected():
    with pytest.raises(TypeError, match="floating point"):
        max_weight(torch.zeros(4, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# Extreme logits: mpmath reference


def _extreme_cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    cases = {
        "gap 1e4": torch.tensor([0.0, -1e4], dtype=torch.float64),
        "gap 1e6": torch.tensor([0.0, -1e6], dtype=torch.float64),
        "offset 1e6 both sides": torch.tensor([1e6, 0.0, -1e6], dtype=torch.float64),
        "near tie + 1e4 gap": torch.tensor([0.0, -1e-9, -1e4, -1e4 - 3.0], dtype=torch.float64),
        "exact tie + 1e4 gap": torch.tensor([5.0, 5.0, 5.0 - 1e4], dtype=torch.float64),
    }
    z = randn(64)
    z[3], z[40] = 1e4, 1e4 - 1e-7
    cases["n=64 near tie at 1e4 above the rest"] = z
    for n, gap in ((4096, 1e4), (1024, 1e6)):
        z = randn(n)
        z[123] = z.max() + gap
        cases[f"n={n} gap {gap:g}"] = z
    z = randn(1024)
    z[[7, 8, 9]] = 1e6
    cases["n=1024 three-way tie 1e6 above"] = z
    z = randn(4096) * 3
    z[2000] = z.max() + 25.0                  # large n, tail mass not negligible
    cases["n=4096 gap 25"] = z
    z = 1e6 + randn(16)                       # large common offset
    cases["offset 1e6 + noise"] = z
    z = randn(2, 3, 256) * 1e4                # batch of rows with 1e4-scale gaps
    cases["batch of 1e4-scale logits"] = z
    return cases


EXTREME = _extreme_cases()


@pytest.mark.parametrize("label", list(EXTREME))
def test_extreme_logits_match_mpmath(label):
    check_against_mpmath(EXTREME[label], label)


def test_extreme_logits_in_one_batch_match_rowwise():
    rows = [v for v in EXTREME.values() if v.shape == (1024,)]
    batch = torch.stack(rows)
    got = all_stats(batch)
    for i, row in enumerate(rows):
        single = all_stats(row)
        for name in STATS:
            assert_close(got[name][i], single[name], rtol=1e-14, atol=0, msg=name)


@pytest.mark.parametrize("gap", [30.0, 100.0, 200.0, 400.0, 600.0])
def test_jacobian_does_not_underflow_at_intermediate_gaps(gap):
    # ||J||_F ~ 2 exp(-gap) is a normal float64 down to gap ~ 708; squaring exp(-gap) first
    # underflows from gap ~ 354 on.  Stable "all the way to one-hot" must cover this range.
    check_against_mpmath(torch.tensor([0.0, -gap], dtype=torch.float64), f"gap {gap}")


def _naive_jacobian_fro(z: torch.Tensor) -> torch.Tensor:
    """The textbook closed form sqrt(sum p^2 - 2 sum p^3 + (sum p^2)^2)."""
    p = torch.softmax(z, dim=-1)
    s2 = (p ** 2).sum(-1)
    return torch.sqrt(s2 - 2 * (p ** 3).sum(-1) + s2 ** 2)


def _naive_fails(naive: float, ref: float) -> bool:
    return math.isnan(naive) or naive == 0.0 or abs(naive - ref) > 1e-2 * abs(ref)


@pytest.mark.parametrize("gap", [20.0, 40.0])
def test_naive_closed_form_fails_where_ours_does_not(gap):
    z = torch.tensor([0.0, -gap, -gap - 1.0], dtype=torch.float64)
    ref = ref_mpmath(z.tolist())["jacobian_fro"]
    assert ref > 0
    assert _naive_fails(float(_naive_jacobian_fro(z)), ref)
    assert_rel(float(jacobian_fro(z)), ref, f"gap {gap}")


def test_naive_closed_form_fails_in_unscaled_regime_d256():
    # Unscaled logits at d_k = 256 over n = 256 keys: q.k_i = |q| g_i, |q|^2 ~ chi2(256).
    rng = np.random.default_rng(4)
    z = torch.from_numpy(np.sqrt(rng.chisquare(256, size=(2000, 1)))
                         * rng.standard_normal((2000, 256)))
    naive, ours = _naive_jacobian_fro(z), jacobian_fro(z)
    assert torch.isfinite(ours).all() and (ours > 0).all()
    suspect = [i for i in range(2000) if _naive_fails(float(naive[i]), float(ours[i]))]
    assert len(suspect) >= 5, "the naive form was expected to break in some rows"
    for i in suspect[:6]:                       # judge both against mpmath on those rows
        ref = ref_mpmath(z[i].tolist())["jacobian_fro"]
        assert _naive_fails(float(naive[i]), ref), f"row {i}"
        assert_rel(float(ours[i]), ref, f"row {i}")


# ---------------------------------------------------------------------------------------------
# Masking, fully masked rows, half precision, ties, batching


def test_masked_keys_equal_stats_over_unmasked_subset():
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(6, 11, generator=gen, dtype=torch.float64) * 4
    mask = torch.rand(6, 11, generator=gen) < 0.4
    mask[:, 0] = False                                  # at least one valid key per row
    mask[1, 1:] = True                                  # a row with exactly one valid key
    zm = z.masked_fill(mask, -math.inf)
    got = all_stats(zm)
    for r in range(6):
        sub = z[r][~mask[r]]
        ref = ref_float64(sub) if sub.numel() > 1 else None
        for name in STATS:
            expected = ref[name] if ref is not None else torch.tensor(
                {"max_weight": 1.0}.get(name, 0.0), dtype=torch.float64)
            assert_close(got[name][r], expected, rtol=1e-10, atol=1e-14, msg=f"row {r} {name}")


def test_masked_keys_with_extreme_logits_match_mpmath():
    z = torch.tensor([[0.0, -math.inf, -1e4, -math.inf, -1e-9],
                      [-math.inf, 1e6, -math.inf, 0.0, -1e6]], dtype=torch.float64)
    check_against_mpmath(z, "masked extreme")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_fully_masked_rows_return_zero_never_nan(dtype):
    z = torch.randn(4, 9, generator=torch.Generator().manual_seed(6)).to(dtype)
    z[1] = -math.inf
    z[3, 2:] = -math.inf
    got = all_stats(z)
    unmasked = all_stats(z[[0, 2]])
    for name in STATS:
        assert not torch.isnan(got[name]).any(), name
        assert got[name][1].item() == 0.0, name
        assert_close(got[name][[0, 2]], unmasked[name], rtol=1e-6, atol=1e-7, msg=name)
    everything_masked = torch.full((2, 3, 5), -math.inf, dtype=dtype)
    for name, value in all_stats(everything_masked).items():
        assert value.shape == (2, 3), name
        assert torch.equal(value, torch.zeros_like(value)), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_finite_float32(dtype):
    gen = torch.Generator().manual_seed(7)
    z = (torch.randn(3, 5, 64, generator=gen) * 6).to(dtype)
    got = all_stats(z)
    ref = ref_float64(z.double())        # same (rounded) logits, exact arithmetic
    for name in STATS:
        assert got[name].dtype == torch.float32, name
        assert torch.isfinite(got[name]).all(), name
        assert_close(got[name].double(), ref[name], rtol=1e-5, atol=1e-6, msg=name)
    big = 6e4 if dtype == torch.float16 else 1e6   # near each format's range
    extreme = torch.tensor([[0.0, -big, -big], [big, 0.0, -big]]).to(dtype)
    got = all_stats(extreme)
    for name in STATS:
        assert got[name].dtype == torch.float32 and torch.isfinite(got[name]).all(), name
    assert_close(got["max_weight"], torch.ones(2), rtol=0, atol=0)
    assert_close(got["entropy"], torch.zeros(2), rtol=0, atol=1e-30)


def test_ties_at_the_max():
    z = torch.tensor([[3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [1.0, 5.0, 5.0, -7.0]],
                     dtype=torch.float64)
    got, ref = all_stats(z), ref_float64(z)
    for name in STATS:
        assert_close(got[name], ref[name], rtol=1e-12, atol=1e-15, msg=name)
    n = 4  # uniform row: J = I/n - 11^T/n^2
    assert_close(got["max_weight"][1], torch.tensor(1 / n, dtype=torch.float64))
    assert_close(got["entropy"][1], torch.tensor(math.log(n), dtype=torch.float64))
    jf = math.sqrt(n * (1 / n - 1 / n**2) ** 2 + n * (n - 1) / n**4)
    assert_close(got["jacobian_fro"][1], torch.tensor(jf, dtype=torch.float64))
    e3 = math.exp(3.0)
    assert_close(got["max_weight"][0], torch.tensor(e3 / (3 * e3 + 1), dtype=torch.float64))


def test_row_results_do_not_depend_on_batching():
    gen = torch.Generator().manual_seed(8)
    z = torch.randn(2, 3, 4, 50, generator=gen, dtype=torch.float64) * 3
    z[0, 1, 2, 7] = -math.inf                           # masking takes a different code path
    batched = all_stats(z)
    flat = all_stats(z.reshape(-1, 50))
    for name in STATS:
        assert_close(flat[name].reshape(2, 3, 4), batched[name], rtol=1e-14, atol=0, msg=name)
        for idx in [(0, 0, 0), (0, 1, 2), (1, 2, 3)]:
            single = FUNCS[name](z[idx])
            assert single.shape == ()
            assert_close(single, batched[name][idx], rtol=1e-14, atol=0, msg=f"{name} {idx}")


# ---------------------------------------------------------------------------------------------
# row_stats: the one entry point, on both backends


def _torch_row_stats(z: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-row columns assembled from the single functions, in float64."""
    z = z.double()
    valid = ~torch.isneginf(z)
    absmax = torch.where(valid, z, torch.zeros_like(z)).abs().amax(dim=-1)
    top = z.amax(dim=-1)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # no key: 0
    return {"count": valid.sum(-1).double(), **all_stats(z), "logit_absmax": absmax,
            "logit_max": top}


def test_row_stats_columns_are_named_once():
    assert stats.ROW_STATS_COLUMNS == ("count", "max_weight", "entropy", "jacobian_fro",
                                       "logit_std", "logit_absmax", "logit_max")
    rows = stats.row_stats(torch.randn(2, 3, 7))
    assert rows.shape == (2, 3, 7) and rows.dtype == torch.float64
    assert list(stats.columns(rows)) == list(stats.ROW_STATS_COLUMNS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_stats_match_the_single_functions(backend, dtype):
    gen = torch.Generator().manual_seed(11)
    z = (torch.randn(3, 4, 40, generator=gen) * 4).to(dtype)
    z[0, 1, 3:9] = -math.inf
    z[2, 0, :] = -math.inf
    z[1, 2, 1:] = -math.inf
    got = stats.columns(stats.row_stats(z))
    ref = _torch_row_stats(upcast(z))
    for name in stats.ROW_STATS_COLUMNS:
        assert_close(got[name], ref[name], rtol=2e-6, atol=1e-6, msg=name)


def test_row_stats_limit_equals_explicit_mask(backend):
    gen = torch.Generator().manual_seed(12)
    z = torch.randn(2, 3, 5, 16, generator=gen)
    limit = torch.tensor([0, 1, 7, 16, 40])          # per query row; clamped to [0, n]
    masked = z.clone()
    for r, lim in enumerate(limit.tolist()):
        masked[..., r, min(lim, 16):] = -math.inf
    assert_close(stats.row_stats(z, limit=limit), stats.row_stats(masked), rtol=1e-6, atol=1e-7)
    assert_close(stats.row_stats(z.double(), limit=limit), stats.row_stats(masked.double()),
                 rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_or_plus_inf_rows_are_nan_everywhere(backend, bad, dtype):
    """One answer for a row with NaN or +inf on every path: NaN in every statistic (as
    torch.softmax gives), with the key still counted."""
    z = torch.tensor([[0.0, bad, -1.0], [bad, -math.inf, -math.inf], [0.0, 1.0, 2.0]],
                     dtype=dtype)
    got = stats.columns(stats.row_stats(z))
    assert_close(got["count"], torch.tensor([3.0, 1.0, 3.0], dtype=torch.float64))
    for name in stats.ROW_STATS_COLUMNS[1:]:
        assert torch.isnan(got[name][:2]).all(), name
        assert torch.isfinite(got[name][2]), name
    for name, fn in FUNCS.items():
        value = fn(z)
        assert torch.isnan(value[:2]).all() and torch.isfinite(value[2]), name
    assert torch.isnan(torch.softmax(z[:1], dim=-1)).any()  # the convention being followed


@pytest.mark.parametrize("fn", [stats.row_stats, *FUNCS.values(), softmax_stats])
def test_empty_last_dimension_is_a_config_error(fn):
    with pytest.raises(attnscale.errors.ConfigError, match="z must have at least one key"):
        fn(torch.zeros(3, 0))


def test_row_stats_bad_arguments():
    with pytest.raises(attnscale.errors.ConfigError, match="limit"):
        stats.row_stats(torch.zeros(2, 3), limit=torch.tensor([1.0]))
    with pytest.raises(attnscale.errors.ConfigError, match="threads"):
        stats.row_stats(torch.zeros(2, 3), threads=0)


# ---------------------------------------------------------------------------------------------
# Gradients: the statistics are loss terms


@pytest.mark.parametrize("name", [*STATS, "softmax_stats", "row_stats"])
def test_statistics_backward(name):
    z = torch.randn(3, 8, requires_grad=True)
    if name == "softmax_stats":
        loss = sum(v.sum() for v in softmax_stats(z).values())
    elif name == "row_stats":
        loss = stats.row_stats(z)[..., 1:].sum()
    else:
        loss = FUNCS[name](z).sum()
    loss.backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()


GRAD_ROWS = {
    "random": [0.3, -1.2, 0.8, 2.0, -0.4],
    "near one-hot": [12.0, 0.0, -1.0, 0.5, -2.0],
    "one-hot in float64": [60.0, 0.0, -3.0, 1.0, 2.0],
    "tie at the top": [1.0, 1.0 + 1e-3, -1.0, 0.0, 0.2],
}


@pytest.mark.parametrize("row", GRAD_ROWS, ids=list(GRAD_ROWS))
@pytest.mark.parametrize("name", STATS)
def test_gradcheck_float64(name, row):
    z = torch.tensor([GRAD_ROWS[row], [0.1, 0.2, -0.3, 0.0, 0.4]], dtype=torch.float64,
                     requires_grad=True)
    assert torch.autograd.gradcheck(FUNCS[name], (z,), eps=1e-6, atol=1e-8, rtol=1e-5)


def test_gradcheck_with_masked_keys():
    keep = torch.tensor([[True, False, True, True], [False, True, True, False]])
    free = torch.tensor([0.5, 1.5, -0.2, 3.0, 1.0], dtype=torch.float64, requires_grad=True)

    def place(x):
        return torch.full(keep.shape, -math.inf, dtype=x.dtype).masked_scatter(keep, x)

    for name in STATS:
        assert torch.autograd.gradcheck(lambda x: FUNCS[name](place(x)), (free,), eps=1e-6,
                                        atol=1e-8, rtol=1e-5), name


def test_entropy_gradient_matches_autograd_of_the_textbook_form():
    z = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(entropy(z).sum(), z)
    p = torch.softmax(z, dim=-1)
    (ref,) = torch.autograd.grad(-(p * p.log()).sum(), z)
    assert_close(g, ref, rtol=1e-10, atol=1e-12)


def test_one_hot_row_has_zero_gradient_not_nan():
    z = torch.tensor([[1e4, 0.0, -1.0], [5.0, -math.inf, -math.inf]], dtype=torch.float64,
                     requires_grad=True)
    for name in ("max_weight", "entropy", "jacobian_fro"):
        (g,) = torch.autograd.grad(FUNCS[name](z).sum(), z)
        assert_close(g, torch.zeros_like(g), rtol=0, atol=1e-300, msg=name)
    (g,) = torch.autograd.grad(logit_std(z[1:]).sum(), z)  # one key: std 0, gradient 0
    assert_close(g, torch.zeros_like(g), rtol=0, atol=0)
