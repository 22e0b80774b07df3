"""Softpick and stick-breaking attention: the blockwise kernels (compiled and PyTorch) and the
materialised pipeline against the float64 definitions of tests/normalisers.py, values and
gradients of q, k and v, with masks, causality at Nq != Nk, rows without keys, one key, half
types, NaN and extreme logits; and their row statistics (attnscale.stats)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from attnscale import stats
from attnscale.attention import attention, attention_reference
from attnscale.kernels import native
from attnscale.kernels.softpick import SOFTPICK_EPS
from attnscale.mechanisms import build_mechanism
from normalisers import SOFTPICK_EPS as REFERENCE_EPS
from normalisers import reference_distribution_stats, reference_weights

NAMES = ("softpick", "stick-breaking")
D = 8


def _inputs(b, h, n_q, n_k, dtype=torch.float64, seed=0, scale=1.5):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, D, generator=gen, dtype=torch.float64) * s
               for n, s in ((n_q, scale), (n_k, scale), (n_k, 1.0)))
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _keep(n_q, n_k, mask, causal):
    keep = torch.ones(n_q, n_k, dtype=torch.bool) if mask is None else mask
    if causal:  # top-left: key j <= query i
        keep = keep & torch.ones(n_q, n_k, dtype=torch.bool).tril()
    return keep


def reference_attention(q, k, v, normaliser, mask=None, causal=False):
    """The definition in float64: p of z = q kᵀ / √d over the attended keys, times v; a query
    without keys gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    z = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    keep = _keep(q.shape[-2], k.shape[-2], mask, causal).expand_as(z)
    return reference_weights(z, keep, normaliser) @ v


def _mask(n_q, n_k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(2, 1, n_q, n_k, generator=gen) > 0.35
    mask[0, 0, min(1, n_q - 1)] = False     # a query without keys
    mask[1, 0, :, 0] = True                 # every query of batch 1 sees key 0
    return mask


def _check(name, q, k, v, mask, causal, rtol, atol, grad_rtol=None, grad_atol=None):
    mech = build_mechanism(name, D, q.shape[1]).to(q.dtype)
    out = attention(q, k, v, mech, mask=mask, causal=causal)
    ref = reference_attention(q, k, v, name, mask, causal)
    assert out.dtype == v.dtype
    assert_close(out.double(), ref, rtol=rtol, atol=atol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        assert_close(a.double(), b.double(), rtol=grad_rtol or rtol, atol=grad_atol or atol)


SHAPES = [(5, 7), (7, 5), (1, 1), (6, 1), (33, 70)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_the_definition_in_float64(name, shape, masked, causal):
    n_q, n_k = shape
    q, k, v = _inputs(2, 3, n_q, n_k)
    mask = _mask(n_q, n_k) if masked else None
    _check(name, q, k, v, mask, causal, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("portable", [False, True, native.AVX2], ids=["best", "v128", "avx2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", NAMES)
def test_compiled_kernel_matches_the_definition_in_float32(name, causal, portable,
                                                           monkeypatch):
    assert native.available(), "the compiled kernels must be built for the tests"
    for fn in ("softpick_probs", "softpick_grad", "stick_breaking_probs", "stick_breaking_grad"):
        real = getattr(native, fn)
        monkeypatch.setattr(native, fn, lambda *a, _f=real, **kw: _f(*a, portable=portable, **kw))
    for n_q, n_k in ((33, 70), (70, 33), (1, 1)):
        q, k, v = _inputs(2, 3, n_q, n_k, dtype=torch.float32)
        _check(name, q, k, v, _mask(n_q, n_k), causal, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", NAMES)
def test_pytorch_path_matches_in_float32(name, monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)
    q, k, v = _inputs(2, 3, 33, 70, dtype=torch.float32)
    _check(name, q, k, v, _mask(33, 70), True, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_half_types_accumulate_in_float32(name, dtype):
    q, k, v = _inputs(2, 3, 17, 23, dtype=dtype)
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    _check(name, q, k, v, _mask(17, 23), True, rtol=tol, atol=tol, grad_rtol=3 * tol,
           grad_atol=3 * tol)


@pytest.mark.parametrize("name", NAMES)
def test_materialised_path_and_blocks_agree(name):
    """trace=True (materialised) and the blockwise kernel, with blocks of a few rows."""
    q, k, v = _inputs(2, 3, 40, 40)
    mech = build_mechanism(name, D, 3).double()
    traced = attention_reference(q, k, v, mech, causal=True)
    assert_close(traced.out, attention(q, k, v, mech, causal=True), rtol=1e-12, atol=1e-13)
    assert_close(traced.weights, reference_weights(
        traced.logits, _keep(40, 40, None, True).expand_as(traced.logits), name))
    from attnscale.kernels import rowwise
    from attnscale.kernels.tiles import Tiles
    small = rowwise.CAPPED_BLOCK_ELEMENTS
    try:  # blocks of 3 rows and one head: the row blocks, the causal prefix and head groups
        rowwise.CAPPED_BLOCK_ELEMENTS = 3 * 40
        assert Tiles(q, k, None, True, rowwise.CAPPED_BLOCK_ELEMENTS).rows == 3
        _check(name, q, k, v, None, True, rtol=1e-10, atol=1e-12)
        _check(name, q, k, v, _mask(40, 40), False, rtol=1e-10, atol=1e-12)
    finally:
        rowwise.CAPPED_BLOCK_ELEMENTS = small


def test_softpick_weights_are_rectified_and_need_not_sum_to_one():
    q, k, v = _inputs(1, 2, 6, 9)
    mech = build_mechanism("softpick", D, 2).double()
    t = attention_reference(q, k, v, mech)
    p = t.weights
    assert bool((p[t.logits <= 0] == 0).all()) and bool((p[t.logits > 0] > 0).all())
    assert bool((p.sum(-1) < 1).all())
    # A row whose logits are all <= 0 attends nothing: zero output, zero gradient.
    q0 = torch.zeros(1, 2, 1, D, dtype=torch.float64, requires_grad=True)
    out = attention(q0, k, v, mech)
    assert torch.equal(out, torch.zeros_like(out))
    assert SOFTPICK_EPS == REFERENCE_EPS


def test_stick_breaking_favours_the_nearest_key_and_leaves_the_rest_of_the_stick():
    """Equal logits: p_j = β (1 - β)^(n - 1 - j), the nearest key (last) the largest."""
    z = torch.full((1, 1, 1, 5), 0.3, dtype=torch.float64)
    beta = torch.sigmoid(torch.tensor(0.3, dtype=torch.float64))
    want = beta * (1 - beta) ** torch.arange(4, -1, -1, dtype=torch.float64)
    from attnscale.pipeline import normalise
    assert_close(normalise(z, "stick-breaking")[0, 0, 0], want)
    assert_close(stats.row_mass(z, "stick-breaking")[0, 0, 0], 1 - (1 - beta) ** 5)


@pytest.mark.parametrize("name", NAMES)
def test_nan_propagates_to_the_rows_it_enters(name):
    """A NaN in a query makes its output row NaN; a NaN in a key makes NaN every row that
    attends it (as SDPA's math path); the other rows stay finite."""
    for dtype in (torch.float32, torch.float64):
        q, k, v = (t.detach().clone() for t in _inputs(1, 2, 6, 6, dtype=dtype))
        q[0, 0, 2, 3] = math.nan
        k[0, 1, 4, 0] = math.nan
        out = attention(q, k, v, build_mechanism(name, D, 2).to(dtype), causal=True)
        nan_rows = out.isnan().any(-1)[0]                                   # (H, Nq)
        want = torch.zeros(2, 6, dtype=torch.bool)
        want[0, 2] = True
        want[1, 4:] = True                                                  # rows that see key 4
        assert torch.equal(nan_rows, want), nan_rows
        assert bool(out.isnan().all(-1)[0][want].all())


@pytest.mark.parametrize("name", NAMES)
def test_extreme_logits_stay_finite(name):
    for dtype in (torch.float32, torch.float64):
        q, k, v = (t.detach().clone() for t in _inputs(1, 2, 9, 9, dtype=dtype, scale=300.0))
        q.requires_grad_()
        mech = build_mechanism(name, D, 2).to(dtype)
        out = attention(q, k, v, mech, causal=True)
        (g,) = torch.autograd.grad(out.sum(), q)
        assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(g).all())
        # (the definition overflows here; float64 runs the same shifted formulation)
        ref = attention(q.double(), k.double(), v.double(), mech.double(), causal=True)
        assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


# --- the compiled row steps against the PyTorch ones --------------------------------------------

@pytest.mark.parametrize("portable", [False, True, native.AVX2], ids=["best", "v128", "avx2"])
def test_row_kernels_match_pytorch_with_limits_masks_and_nan(portable):
    from attnscale.kernels.softpick import softpick_parts
    from attnscale.kernels.stick_breaking import stick_breaking_weights
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(3, 5, 37, generator=gen) * 3
    z[0, 1, 4] = -math.inf
    z[1, :, 30:] = -math.inf
    z[2, 0] = -math.inf                                   # no key
    z[2, 4, 7] = math.nan
    z[0, 2] = -torch.rand(37, generator=gen)              # every logit <= 0
    limit = torch.tensor([37, 20, 1, 0, 37], dtype=torch.int64)
    seen = z.clone()
    for r, n in enumerate(limit.tolist()):
        seen[:, r, n:] = -math.inf
    g = torch.randn(3, 5, 37, generator=gen)
    ref = seen.double().requires_grad_()

    u, d, _, _ = softpick_parts(ref)
    p_ref = torch.relu(u) / d
    st = torch.empty(3, 5, 2)
    p = native.softpick_probs(z, st, limit=limit, portable=portable)
    (dz_ref,) = torch.autograd.grad(p_ref, ref, g.double())
    delta = (g.double() * p_ref).sum(-1, keepdim=True).float().nan_to_num()
    dz = native.softpick_grad(z, g.clone(), st, delta, limit=limit, portable=portable)
    ok = ~seen.isnan().any(-1, keepdim=True).expand_as(z)
    assert_close(p[ok].double(), p_ref.detach()[ok], rtol=2e-6, atol=1e-7)
    assert_close(dz[ok].double(), dz_ref[ok], rtol=2e-5, atol=1e-6)
    assert bool(p[~ok].isnan().any()) and bool((p[..., 20:][:, 1] == 0).all())

    p_ref = stick_breaking_weights(ref)
    p = native.stick_breaking_probs(z, limit=limit, portable=portable)
    (dz_ref,) = torch.autograd.grad(p_ref, ref, g.double())
    dz = native.stick_breaking_grad(z, p.clone(), g.clone(), limit=limit, portable=portable)
    assert_close(p[ok].double(), p_ref.detach()[ok], rtol=2e-6, atol=1e-7)
    assert_close(dz[ok].double(), dz_ref[ok], rtol=2e-5, atol=1e-6)
    assert bool(p[~ok].isnan().any())
    with pytest.raises(ValueError, match="share memory"):
        native.stick_breaking_probs(z, out=z)


# --- statistics ---------------------------------------------------------------------------------

def _logit_rows(seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(2, 3, 6, 11, generator=gen, dtype=torch.float64) * 2
    keep = torch.rand(2, 3, 6, 11, generator=gen) > 0.3
    keep[0, 0, 0] = False                                  # no key
    keep[1, 2, 3] = False
    keep[1, 2, 3, 5] = True                                # one key
    z[0, 1, 2] = -torch.rand(11, generator=gen, dtype=torch.float64)  # all <= 0
    z[1, 0, 1, 4] = 40.0                                   # near one-hot
    return z, keep


@pytest.mark.parametrize("name", NAMES)
def test_row_statistics_match_the_definitions(name):
    z, keep = _logit_rows()
    masked = z.masked_fill(~keep, -math.inf)
    got = stats.columns(stats.row_stats(masked, normaliser=name))
    want = reference_distribution_stats(z, keep, name)
    for column in ("max_weight", "entropy", "jacobian_fro"):
        assert_close(got[column], want[column], rtol=1e-9, atol=1e-12)
    assert_close(stats.row_mass(masked, name), want["mass"], rtol=1e-12, atol=1e-14)
    assert_close(got["count"], keep.sum(-1).double())
    # float32 logits agree to float32 rounding; the limit hides keys like a mask.
    limit = torch.tensor([11, 4, 1, 0, 7, 11], dtype=torch.int64)
    hidden = torch.arange(11) >= limit[:, None]
    got32 = stats.row_stats(z.float().masked_fill(~keep, -math.inf), normaliser=name,
                            limit=limit)
    want32 = reference_distribution_stats(z, keep & ~hidden, name)
    for i, column in enumerate(stats.ROW_STATS_COLUMNS):
        if column in want32:
            assert_close(got32[..., i], want32[column], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", NAMES)
def test_row_statistics_special_rows(name):
    z = torch.tensor([[-math.inf] * 4, [0.5, math.nan, 1.0, 2.0], [3.0, -math.inf, -1, 0.2]],
                     dtype=torch.float64)
    rows = stats.columns(stats.row_stats(z, normaliser=name))
    for column in ("max_weight", "entropy", "jacobian_fro"):
        assert rows[column][0] == 0 and math.isnan(rows[column][1])
        assert math.isfinite(rows[column][2])
    mass = stats.row_mass(z, name)
    assert mass[0] == 0 and math.isnan(mass[1])


def _mp_stats(z: list[float], name: str) -> tuple[float, float]:
    """(entropy of p / Σp, ||∂p/∂z||_F) of one row at 50 digits: the weights from the
    definitions and the Jacobian by mpmath's numerical differentiation."""
    import mpmath
    mpmath.mp.dps = 50

    def weights(zs):
        if name == "softpick":
            s = sum(abs(mpmath.expm1(x)) for x in zs) + mpmath.mpf(REFERENCE_EPS)
            return [max(mpmath.expm1(x), 0) / s for x in zs]
        beta = [1 / (1 + mpmath.exp(-x)) for x in zs]
        return [beta[j] * mpmath.fprod(1 - b for b in beta[j + 1:]) for j in range(len(zs))]

    zs = [mpmath.mpf(x) for x in z]
    p = weights(zs)
    total = sum(p)
    ent = -sum(x / total * mpmath.log(x / total) for x in p if x > 0)
    jac = 0
    for i in range(len(zs)):
        for j in range(len(zs)):
            def pij(x, i=i, j=j):
                return weights(zs[:j] + [x] + zs[j + 1:])[i]
            jac += mpmath.diff(pij, zs[j]) ** 2
    return float(ent), float(mpmath.sqrt(jac))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", NAMES)
def test_statistics_stay_exact_near_one_hot(name, dtype):
    """A top logit far above the rest: 1 - p_t and ||J||_F come from the other keys' terms (no
    difference of numbers close to 1), against a 50-digit reference."""
    for row in ([30.0, 1.0, 0.5, -2.0], [1.0, -3.0, 0.5, 25.0], [12.0, 0.3, 0.2, 0.1]):
        got = stats.columns(stats.row_stats(torch.tensor([row], dtype=dtype), normaliser=name))
        ent, jac = _mp_stats(row, name)
        rtol = 1e-4 if dtype == torch.float32 else 1e-9
        assert got["jacobian_fro"].item() == pytest.approx(jac, rel=rtol)
        assert got["entropy"].item() == pytest.approx(ent, rel=rtol, abs=1e-12)


# --- QK-Clip and the guard ----------------------------------------------------------------------

@pytest.mark.parametrize("name, options", [("softpick", {}), ("stick-breaking", {}),
                                           ("mscale", {"factor": 40.0})])
def test_qk_clip_holds_the_logits_of_the_new_mechanisms(name, options):
    """Their logits are scale · q kᵀ of the projections (``bilinear``): S_max is the largest
    logit entering the normaliser and the clip bounds it; the guard's records are the
    normaliser's statistics."""
    import attnscale
    from attnscale.attention import MultiHeadAttention
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, name, **options)
    x = torch.randn(4, 12, 32)
    opt = torch.optim.SGD(mha.parameters(), lr=2.0)
    with attnscale.guard(mha, optimizer=opt, qk_clip=1.0, strict=True, every=1,
                         alarm_logit=None, alarm_entropy_fraction=None) as g:
        for step in range(4):
            mha(x, causal=True).square().mean().neg().backward()
            opt.step()
            opt.zero_grad()
            g.step(step)
    with torch.no_grad():
        z = mha.logits(x).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), -math.inf)
    assert float(z.amax()) <= 1.0 + 1e-5
    assert any(r["clip_gamma"] < 1 for r in g.records)
    assert all(math.isfinite(r["entropy_mean"]) for r in g.records)
    # The guard's statistics are the monitor's, under the mechanism's normaliser.
    with attnscale.monitor(mha) as mon, torch.no_grad():
        mha(x, causal=True)
    want = reference_distribution_stats(z.double(), torch.isfinite(z), mha.mechanism.normaliser)
    for key, column in (("entropy_mean", "entropy"), ("jacobian_fro_mean", "jacobian_fro"),
                        ("mass_mean", "mass")):
        got = torch.tensor([r[key] for r in mon.records], dtype=torch.float64)
        assert_close(got, want[column].mean((0, 2)), rtol=1e-4, atol=1e-6)


def test_qk_clip_refuses_qk_rmsnorm_over_the_model_in_one_line():
    import attnscale
    from attnscale.attention import MultiHeadAttention
    from attnscale.errors import ConfigError
    for over in ("head", "model"):
        with pytest.raises(ConfigError, match="do not scale with W_Q and W_K") as err:
            attnscale.guard(MultiHeadAttention(16, 2, "qk-rmsnorm", over=over), qk_clip=10.0)
        assert "\n" not in str(err.value)
