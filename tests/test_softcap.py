"""The blockwise soft-capped kernel against the materialised reference, forward and backward."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.testing import assert_close

from attnscale.attention import attention_reference, key_mask
from attnscale.kernels.softcap import _CappedAttention, _Tiles
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


def test_finite_where_sigmoid_saturates(backend):
    # |s| in the hundreds: σ(s) is 0 or 1 to float32 precision; weights and gradients stay finite
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
            lambda q, k, v: _CappedAttention.apply(q, k, v, mask, 0.3, 1.5, causal, 7),
            (q, k, v), fast_mode=True)


def test_blocks_hold_a_bounded_number_of_logits():
    # Extra memory is O(Nk · rows): no block exceeds the budget unless one row alone does.
    q, k, _ = _inputs(50, 64)
    for budget in (64, 200, 1000, 10**6):
        for causal in (False, True):
            tiles = _Tiles(q, k, None, causal, budget)
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
