"""The blockwise soft-capped kernel against the materialised reference, forward and backward."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close

from attnscale.attention import attention_reference, key_mask
from attnscale.kernels import native
from attnscale.kernels.softcap import _CappedAttention
from attnscale.kernels.tiles import Tiles
from attnscale.mechanisms import build_mechanism
from attnscale.mechanisms.softcap import GEMMA2_CAP, GROK1_CAP

# By module name: the package re-exports the function ``attnscale.attention`` under that name.
attention_module = importlib.import_module("attnscale.kernels.softcap")
B, H, D = 2, 3, 8


def _inputs(nq, nk, dtype=torch.float64, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) * s).to(dtype)
            .requires_grad_() for n, s in ((nq, scale), (nk, scale), (nk, 1.0))]


def _mask(shape, seed=0):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.3


def _check(q, k, v, cap, mask=None, causal=False, rtol=1e-10, atol=1e-12):
    """The kernel (through the softcap mechanism) against attention_reference, with gradients."""
    mech = build_mechanism("softcap", D, H, cap=cap).to(q.dtype)
    fast = mech(q, k, v, mask=mask, causal=causal)
    ref = attention_reference(q, k, v, mech, mask=mask, causal=causal).out
    assert_close(fast, ref, rtol=rtol, atol=atol)
    g = torch.randn(fast.shape, generator=torch.Generator().manual_seed(3), dtype=fast.dtype)
    for a, b in zip(torch.autograd.grad(fast, (q, k, v), g),
                    torch.autograd.grad(ref, (q, k, v), g)):
        assert_close(a, b, rtol=rtol, atol=atol)


MASK_SHAPES = {  # every way a mask can broadcast to (B, H, Nq, Nk)
    "none": None,
    "(Nq, Nk)": lambda nq, nk: (nq, nk),
    "(B, 1, Nq, Nk)": lambda nq, nk: (B, 1, nq, nk),
    "(1, H, 1, Nk)": lambda nq, nk: (1, H, 1, nk),
    "(B, H, Nq, Nk)": lambda nq, nk: (B, H, nq, nk),
    "(Nk,)": lambda nq, nk: (nk,),
}


# One row per block; a few rows; all rows of 2 of the 3 heads (a partial head group); everything.
@pytest.mark.parametrize("block_elements", [1, 24, 150, 2**22])
@pytest.mark.parametrize("mask_shape", list(MASK_SHAPES))
def test_blockwise_matches_reference(monkeypatch, block_elements, mask_shape):
    monkeypatch.setattr(attention_module, "CAPPED_BLOCK_ELEMENTS", block_elements)
    for nq, nk, causal in ((7, 9, True), (9, 7, True), (8, 8, False)):
        q, k, v = _inputs(nq, nk, scale=4.0)  # large enough that the tanh bends
        shape = MASK_SHAPES[mask_shape]
        mask = None if shape is None else _mask(shape(nq, nk))
        _check(q, k, v, cap=2.0, mask=mask, causal=causal)


@pytest.mark.parametrize("mask_shape", ["none", "(B, 1, Nq, Nk)", "(1, H, 1, Nk)"])
def test_head_groups_in_parallel_match_reference(monkeypatch, mask_shape):
    # With several torch threads the head groups run side by side (one head per group here, so
    # B * H = 6 groups over 3 workers); forward and all gradients must still match.
    monkeypatch.setattr(attention_module, "CAPPED_BLOCK_ELEMENTS", 24)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for nq, nk, causal in ((7, 9, True), (8, 8, False)):
            q, k, v = _inputs(nq, nk, scale=4.0)
            shape = MASK_SHAPES[mask_shape]
            mask = None if shape is None else _mask(shape(nq, nk))
            _check(q, k, v, cap=2.0, mask=mask, causal=causal)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("block_elements", [1, 24, 150, 2**22])
@pytest.mark.parametrize("mask_shape", ["none", "(Nq, Nk)", "(1, H, 1, Nk)", "(B, H, Nq, Nk)"])
def test_float32_blockwise_matches_reference(monkeypatch, backend, block_elements,
                                             mask_shape):
    # float32 against the float64 reference: forward and every gradient, with and without the
    # compiled elementwise kernels, over block shapes, masks, causality and widths that are not
    # a multiple of the vector width.
    monkeypatch.setattr(attention_module, "CAPPED_BLOCK_ELEMENTS", block_elements)
    for nq, nk, causal in ((7, 9, True), (9, 7, True), (19, 19, False), (5, 37, False)):
        q, k, v = _inputs(nq, nk, dtype=torch.float32, scale=4.0)
        shape = MASK_SHAPES[mask_shape]
        mask = None if shape is None else _mask(shape(nq, nk))
        _check(q, k, v, cap=2.0, mask=mask, causal=causal, rtol=1e-4, atol=1e-5)


def test_finite_where_tanh_saturates(backend):
    # |x| in the hundreds: tanh(x) is ±1 to float32 precision; weights and gradients stay finite
    # and match the float64 reference.
    q, k, v = _inputs(12, 12, dtype=torch.float32, scale=40.0)
    _check(q, k, v, cap=1.0, causal=True, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cap", [GEMMA2_CAP, GROK1_CAP, 0.5])
def test_float32_matches_reference(monkeypatch, cap):
    monkeypatch.setattr(attention_module, "CAPPED_BLOCK_ELEMENTS", 40)
    q, k, v = _inputs(33, 40, dtype=torch.float32, scale=6.0)
    _check(q, k, v, cap=cap, mask=_mask((B, 1, 33, 40)), rtol=1e-4, atol=1e-5)
    _check(q, k, v, cap=cap, causal=True, rtol=1e-4, atol=1e-5)


def test_gradcheck_over_several_blocks():
    q, k, v = _inputs(5, 6)
    mask = _mask((5, 6), seed=1)
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v: _CappedAttention.apply(q, k, v, mask, 0.3, 1.5, causal, 7, None, None),
            (q, k, v), fast_mode=True)


def test_blocks_hold_a_bounded_number_of_logits():
    # Extra memory is O(Nk · rows): no block exceeds the budget unless one row alone does.
    q, k, _ = _inputs(50, 64)
    for budget in (64, 200, 1000, 10**6):
        for causal in (False, True):
            tiles = Tiles(q, k, None, causal, budget)
            seen, sizes = [], []
            for b, heads in tiles.groups():
                (row_blocks,) = tiles.split(b, heads, q)
                for i, blk in enumerate(row_blocks):
                    sizes.append(blk.shape[0] * blk.shape[1] * tiles.n_keys(i))
                    seen += [(b, h, i * tiles.rows + r) for h in range(H)[heads]
                             for r in range(blk.shape[1])]
            assert max(sizes) <= max(budget, 64)
            assert sorted(seen) == [(b, h, i) for b in range(B) for h in range(H)
                                    for i in range(50)]  # every query exactly once


def test_logits_are_capped_and_fully_masked_rows_are_zero():
    q, k, v = _inputs(6, 6, dtype=torch.float32, scale=300.0)
    mech = build_mechanism("softcap", D, H)
    z = mech.logits(q, k)
    assert torch.isfinite(z).all() and z.abs().max() <= GEMMA2_CAP
    mask = key_mask(None, True, q, k).clone()
    mask[3] = False
    out = mech(q, k, v, mask=mask)
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert (out[..., 3, :] == 0).all() and (dq[..., 3, :] == 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()


# ---------------------------------------------------------------------------------------------
# Precision at any cap: c · tanh(x) → c x as c grows, and the kernel must follow it
# to the rounding of its dtype.  The old form 2c · σ(2x) - c lost |c| · 2^-24 absolutely
# (7.6e-4 at c = 1e4, 0.09 at 1e6 in float32).

CAPS = [1.0, 30.0, 1e4, 1e6, 1e8]
# float32: q, k ~ 3 randn give logits up to ~20 and near one-hot rows; the float32 reference
# itself is off from float64 by up to ~1e-5 there (measured 7e-6), so 3e-5 absolute on outputs
# of size ~1, relative to the largest entry for gradients.  float64: the same at 2^-52 scale.
TOLERANCE = {torch.float32: 3e-5, torch.float64: 1e-12}


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_any_cap_matches_the_float64_reference(backend, cap, dtype, causal):
    gen = torch.Generator().manual_seed(5)
    q64, k64, v64 = (torch.randn(B, H, 24, D, generator=gen, dtype=torch.float64) * s
                     for s in (3.0, 3.0, 1.0))
    mech = build_mechanism("softcap", D, H, cap=cap)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
    out = mech.to(dtype)(q, k, v, causal=causal)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_in, mech.double(), causal=causal).out
    tol = TOLERANCE[dtype]
    assert_close(out.double(), ref, rtol=tol, atol=tol)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g.to(dtype)),
                    torch.autograd.grad(ref, ref_in, g)):
        assert_close(a.double(), b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("cap", CAPS)
def test_float32_reference_is_accurate_at_any_cap(cap):
    # attention_reference forms c · tanh(z / c) in the input dtype: in float32 it must stay at
    # float32 rounding from the float64 reference however large c is.
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, H, 24, D, generator=gen, dtype=torch.float64) * s
               for s in (3.0, 3.0, 1.0))
    mech = build_mechanism("softcap", D, H, cap=cap)
    ref32 = attention_reference(q.float(), k.float(), v.float(), mech).out
    ref64 = attention_reference(q, k, v, mech.double()).out
    assert_close(ref32.double(), ref64, rtol=3e-5, atol=3e-5)


def _tanh_inputs(n: int = 203) -> torch.Tensor:
    """Logits over every regime of tanh: 0, ±tiny, around 1, saturated, masked (-inf)."""
    gen = torch.Generator().manual_seed(7)
    s = torch.randn(3, 4, n, generator=gen, dtype=torch.float64)
    s = s * torch.logspace(-9, 2, n, dtype=torch.float64)   # |s| from 1e-9 to 100 along a row
    s[0, 0, 0], s[0, 1, 5], s[1, 2, 7] = 0.0, -1e-30, 30.0
    s[2, :, ::5] = float("-inf")
    return s


@pytest.mark.parametrize("portable", [False, True, native.AVX2], ids=["native", "portable", "avx2"])
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("limited", [False, True], ids=["all keys", "causal counts"])
def test_compiled_softcap_kernels_against_float64(portable, cap, limited):
    # Every instruction-set build of the compiled kernels, on logits in every regime (the tanh
    # polynomial below 0.625, the expm1 form above it, both in one vector), against
    # softmax(c tanh(s)) and its backward in float64.  s is scaled by 0.1 / c so the capped
    # logits stay within ~30 (at c = 1, |s| still reaches ~30, where tanh saturates): exp(z - max)
    # carries z's float32 rounding, ~30 · 2^-24 = 2e-6 relative, below rtol.  Where the kernels
    # are not built, the typed wrappers refuse with RuntimeError naming ATTNSCALE_NATIVE.
    s = (_tanh_inputs() * (0.1 / cap)).float()
    stats = torch.empty(*s.shape[:-1], 2)
    if not native.available():
        with pytest.raises(RuntimeError, match=native.NATIVE_ENV):
            native.softcap_exp(s, cap, stats, portable=portable)
        return
    n = s.shape[-1]
    rows = s[..., 0].numel()
    # causality as counts: row r sees its first limit[r % len] keys (one row sees none)
    limit = torch.arange(rows, dtype=torch.int64) * n // rows if limited else None
    sd = s.double()
    seen = torch.ones(s.shape, dtype=torch.bool)
    if limited:
        seen = (torch.arange(n) < limit.view(*s.shape[:-1], 1))
    z = (cap * torch.tanh(sd)).masked_fill((sd == float("-inf")) | ~seen, float("-inf"))
    keyless = torch.isneginf(z).all(-1, keepdim=True)
    p_ref = torch.softmax(z, dim=-1).masked_fill(keyless, 0.0)
    e = native.softcap_exp(s, cap, stats, limit=limit, portable=portable)
    assert_close(e.double() * stats[..., 1:].double(), p_ref, rtol=1e-5, atol=1e-7)
    assert torch.equal(stats[..., 0].isneginf(), keyless.squeeze(-1))
    gen = torch.Generator().manual_seed(8)
    dp = torch.randn(s.shape, generator=gen)
    delta = (p_ref.float() * dp).sum(-1, keepdim=True)
    p, ds = native.softcap_backward(s.clone(), dp.clone(), stats, delta, cap, limit=limit,
                                   portable=portable)
    assert_close(p.double(), p_ref, rtol=1e-5, atol=1e-7)
    ds_ref = p_ref * (dp.double() - delta.double()) * (1 - torch.tanh(sd) ** 2)
    assert_close(ds.double(), ds_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not native.available(), reason="attnscale's compiled kernels are not built")
@pytest.mark.parametrize("portable", [False, True, native.AVX2], ids=["native", "portable", "avx2"])
def test_compiled_softcap_kernels_nan_rows(portable):
    # A NaN among the keys a row sees makes the row NaN over those keys, forward and backward;
    # the keys it does not see stay 0, and the other rows are untouched.
    s = torch.randn(3, 40) * 0.01
    s[1, 7] = float("nan")
    stats = torch.empty(3, 2)
    limit = torch.tensor([40, 20, 5])
    e = native.softcap_exp(s, 50.0, stats, limit=limit, portable=portable)
    assert torch.isnan(e[1, :20]).all() and torch.equal(e[1, 20:], torch.zeros(20))
    assert torch.isnan(stats[1]).all() and torch.isfinite(e[[0, 2]]).all()
    p, ds = native.softcap_backward(s.clone(), torch.ones(3, 40), stats, torch.zeros(3, 1), 50.0,
                                    limit=limit, portable=portable)
    assert torch.isnan(p[1, :20]).all() and torch.equal(p[1, 20:], torch.zeros(20))
    assert torch.isnan(ds[1, :20]).all() and torch.isfinite(ds[[0, 2]]).all()
    assert torch.equal(p[2, 5:], torch.zeros(35))


def test_compiled_kernels_load_where_built():
    # A build that exists must load (a stale one from another contract version is refused, and
    # then this fails instead of silently running the PyTorch formulation).
    import importlib.util
    import os
    built = importlib.util.find_spec("attnscale._kernels") is not None
    enabled = os.environ.get(native.NATIVE_ENV, "1") != "0"
    assert native.available() == (built and enabled)


@pytest.mark.parametrize("bad", ["float64", "strided", "shape"])
def test_typed_wrappers_refuse_bad_tensors(bad):
    # Checked before the library is touched, so the same errors where it is not built.
    s = torch.zeros(2, 3, 8)
    dp, delta, stats = torch.zeros_like(s), torch.zeros(2, 3, 1), torch.zeros(2, 3, 2)
    if bad == "float64":
        with pytest.raises(ValueError, match=r"\bs\b.*float32"):
            native.softcap_exp(s.double(), 1.0, stats)
    elif bad == "strided":
        with pytest.raises(ValueError, match=r"\bs\b.*unit stride"):
            native.softcap_exp(s.transpose(1, 2), 1.0, stats)
    else:
        with pytest.raises(ValueError, match=r"\bstats\b.*shape"):
            native.softcap_exp(s, 1.0, stats[..., :1])
        with pytest.raises(ValueError, match=r"\bdp\b.*shape"):
            native.softcap_backward(s, dp[..., :4], stats, delta, 1.0)
        with pytest.raises(ValueError, match=r"\bdelta\b.*shape"):
            native.softcap_backward(s, dp, stats, delta[:1], 1.0)


# ---------------------------------------------------------------------------------------------
# NaN inputs: a NaN reaches exactly the outputs that depend on it, on every backend, as in
# attention_reference (the rule of attnscale.kernels.nans; tests/test_nan_rule.py covers every
# mechanism).  Under causality SDPA's math backend also spreads a NaN to the queries that
# cannot see it; the rule does not.

NAN_AT = (1, 2, 4, 1)  # (b, h, position, feature) of the NaN


def _nan_rows(out: Tensor) -> Tensor:
    return out.isnan().any(-1)


@pytest.mark.parametrize("block_elements", [24, 2**19], ids=["blocks", "one-block"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_inputs_give_nan_where_they_reach(monkeypatch, backend, block_elements, where,
                                              causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    monkeypatch.setattr(attention_module, "CAPPED_BLOCK_ELEMENTS", block_elements)
    gen = torch.Generator().manual_seed(9)
    n = 9
    qkv = dict(zip("qkv", (torch.randn(B, H, n, D, generator=gen) for _ in range(3))))
    qkv[where][NAN_AT] = float("nan")
    mech = build_mechanism("softcap", D, H, cap=30.0)
    got = _nan_rows(mech(qkv["q"], qkv["k"], qkv["v"], causal=causal))
    ref = _nan_rows(attention_reference(qkv["q"], qkv["k"], qkv["v"], mech, causal=causal).out)
    with sdpa_kernel(SDPBackend.MATH):
        sdpa = _nan_rows(F.scaled_dot_product_attention(qkv["q"], qkv["k"], qkv["v"],
                                                        is_causal=causal))
    b, h, pos, _ = NAN_AT
    reached = torch.zeros(B, H, n, dtype=torch.bool)     # rows whose output depends on the NaN
    if where == "q":
        reached[b, h, pos] = True
    else:
        reached[b, h, pos if causal else 0:] = True
    assert torch.equal(got, reached) and torch.equal(ref, reached)  # exactly the dependent rows
    if not causal:  # SDPA's math backend adds the causal mask as -inf, and NaN + -inf is NaN
        assert torch.equal(got, sdpa)


def test_masked_nan_key_stays_hidden(backend):
    # A NaN key that the mask hides from some queries reaches only the others.
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(B, H, 6, D, generator=gen) for _ in range(3))
    k[0, 1, 2, 0] = float("nan")
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[:3, 2] = False   # queries 0-2 do not see key 2
    mech = build_mechanism("softcap", D, H, cap=30.0)
    got = _nan_rows(mech(q, k, v, mask=mask))
    ref = _nan_rows(attention_reference(q, k, v, mech, mask=mask).out)
    expected = torch.zeros(B, H, 6, dtype=torch.bool)
    expected[0, 1, 3:] = True
    assert torch.equal(got, expected) and torch.equal(ref, expected)


# ---------------------------------------------------------------------------------------------
# Tracing, compiling and export: the blockwise kernel hands raw memory to C and
# runs blocks on worker threads, which fake tensors cannot do; under a tracer it runs the
# materialised formulation, which records as plain torch ops.


class _SoftcapAttention(torch.nn.Module):
    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from attnscale.attention import attention
        return attention(q, k, v, "softcap", causal=True)


def _trace_inputs(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, 10, D, generator=gen) * 3 for _ in range(3))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("recorder", ["jit.trace", "export", "compile"])
def test_traced_exported_and_compiled_softcap_equal_eager(backend, recorder):
    module = _SoftcapAttention()
    example = _trace_inputs(0)
    if recorder == "jit.trace":
        recorded = torch.jit.trace(module, example)
    elif recorder == "export":
        recorded = torch.export.export(module, example).module()
    else:  # dynamo with fake tensors, without a C++ toolchain
        recorded = torch.compile(module, backend="aot_eager", fullgraph=True)
    for seed in (0, 1):  # the recorded graph on the example and on new inputs
        inputs = _trace_inputs(seed)
        assert_close(recorded(*inputs), module(*inputs))


# ---------------------------------------------------------------------------------------------
# Threads: head groups run on worker threads whose torch ops use one intra-op
# thread each, so W workers on W cores do not open W OpenMP teams of W threads.


def test_workers_run_torch_ops_on_one_thread_and_keep_the_default():
    import threading

    from attnscale.workers import parallel_map
    torch.set_num_threads(2)   # the autouse fixture restores the suite's setting
    seen = parallel_map(lambda _: torch.get_num_threads(), range(6), 2)
    assert seen == [1] * 6
    assert torch.get_num_threads() == 2                    # the caller's setting is untouched
    fresh: list[int] = []
    thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert fresh == [2]                                    # and so is the default new threads take
