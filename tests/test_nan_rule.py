"""The NaN rule of attnscale.kernels.nans on every mechanism, dtype, shape and kernel path: a NaN
in q, k or v reaches exactly the outputs that depend on it (the rows attending a NaN key, entry c
for a NaN in v[..., c]), never a row that does not attend it, and a row with no key is zero.
``attention()`` and ``attention_reference()`` give the same NaN and the same finite numbers."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from attnscale.attention import attention, attention_reference
from attnscale.kernels import entropy, nans, sigmoid, softcap
from attnscale.mechanisms import MECHANISMS

B, H, D = 2, 2, 8
AT_B, AT_H, AT_C = 1, 1, 3                      # batch, head and feature of every NaN
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# (Nq, Nk): one key, a row shorter than the CPU flash kernel's SIMD vector, Nq != Nk both ways,
# and rows long enough for its vector path
SHAPES = [(1, 1), (3, 5), (6, 4), (9, 9), (20, 70)]
MASKINGS = ["none", "mask", "causal", "mask+causal"]
# Finite entries, fast path against the reference in the same dtype
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _masking(kind: str, n_q: int, n_k: int) -> tuple[torch.Tensor | None, bool, torch.Tensor]:
    """(mask, causal, attended (Nq, Nk)): a random mask with row Nq // 2 attending nothing."""
    attended = torch.ones(n_q, n_k, dtype=torch.bool)
    mask = None
    if "mask" in kind:
        mask = torch.rand(n_q, n_k, generator=torch.Generator().manual_seed(n_q * 97 + n_k)) > 0.3
        mask[:, n_k // 2] |= torch.arange(n_q) % 2 == 1  # the NaN key: seen by some rows only
        mask[n_q // 2] = False
        attended &= mask
    causal = "causal" in kind
    if causal:
        attended &= torch.ones(n_q, n_k, dtype=torch.bool).tril()
    return mask, causal, attended


def _expected(where: str, attended: torch.Tensor, n_q: int, n_k: int,
              whole_rows: bool = False) -> torch.Tensor:
    """Which outputs (B, H, Nq, D) the rule makes NaN, from the attended keys alone;
    ``whole_rows``: the mechanism normalises each output row (differential's RMSNorm), so a NaN
    in one entry of v reaches every entry of the rows that attend it."""
    want = torch.zeros(B, H, n_q, D, dtype=torch.bool)
    if where == "q":
        for i in {0, n_q // 2}:
            want[AT_B, AT_H, i] = attended[i].any()
    elif where == "k" or whole_rows:
        want[AT_B, AT_H] = attended[:, n_k // 2, None]
    else:
        want[AT_B, AT_H, :, AT_C] = attended[:, n_k // 2]
    return want


def _inputs(where: str, dtype: torch.dtype, n_q: int, n_k: int, d_v: int = D):
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(B, H, n, D, generator=gen).to(dtype) for n in (n_q, n_k))
    v = torch.randn(B, H, n_k, d_v, generator=gen).to(dtype)
    if where == "q":
        q[AT_B, AT_H, [0, n_q // 2], AT_C] = float("nan")
    else:
        {"k": k, "v": v}[where][AT_B, AT_H, n_k // 2, AT_C] = float("nan")
    return q, k, v


def _check(name: str, dtype: torch.dtype, shape: tuple[int, int], kind: str, where: str) -> None:
    n_q, n_k = shape
    mask, causal, attended = _masking(kind, n_q, n_k)
    q, k, v = _inputs(where, dtype, n_q, n_k)
    got = attention(q, k, v, name, mask=mask, causal=causal)
    ref = attention_reference(q, k, v, name, mask=mask, causal=causal).out
    want = _expected(where, attended, n_q, n_k, MECHANISMS[name].normalises_output)
    case = f"{name} {dtype} {shape} {kind} NaN in {where}"
    assert torch.equal(ref.isnan(), want), f"reference: {case}"
    assert torch.equal(got.isnan(), want), f"attention: {case}"
    tol = TOL[dtype]
    assert_close(got[~want].double(), ref[~want].double(), rtol=tol, atol=tol, msg=case)


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_every_mechanism_follows_the_rule_in_both_paths(name):
    for dtype in DTYPES:
        for shape in SHAPES:
            for kind in MASKINGS:
                for where in "qkv":
                    _check(name, dtype, shape, kind, where)


@pytest.fixture
def small_blocks(monkeypatch):
    """The blockwise kernels cut into many blocks: a few rows against a few keys each."""
    monkeypatch.setattr(softcap, "CAPPED_BLOCK_ELEMENTS", 24)
    monkeypatch.setattr(sigmoid, "CAPPED_BLOCK_ELEMENTS", 24)
    monkeypatch.setattr(entropy, "ENTROPY_BLOCK_ELEMENTS", 24)


@pytest.mark.parametrize("name", ["softcap", "sigmoid", "adaptive-temp", "sink"])
def test_blockwise_kernels_follow_the_rule_in_many_blocks(backend, small_blocks, name):
    # compiled C kernels and PyTorch formulations alike
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((9, 9), (20, 70)):
            for kind in MASKINGS:
                for where in "qkv":
                    _check(name, dtype, shape, kind, where)


@pytest.mark.parametrize("name", ["scaled", "sink", "sigmoid", "softcap"])
def test_values_wider_than_the_head_follow_the_rule(name):
    # d_v != d sends the sink to SDPA with an extra key instead of the CPU flash op
    mask, causal, attended = _masking("mask+causal", 9, 9)
    q, k, v = _inputs("v", torch.float32, 9, 9, d_v=2 * D)
    got = attention(q, k, v, name, mask=mask, causal=causal)
    ref = attention_reference(q, k, v, name, mask=mask, causal=causal).out
    want = torch.zeros_like(got, dtype=torch.bool)
    want[AT_B, AT_H, :, AT_C] = attended[:, 4]
    assert torch.equal(got.isnan(), want) and torch.equal(ref.isnan(), want)
    assert_close(got[~want], ref[~want])


@pytest.mark.parametrize("where", "qkv")
def test_selective_attention_carries_a_nan_of_its_first_head_as_its_formula(where):
    # The selection sums the first head's logits of the queries between a key and a query, so a
    # NaN in that head's q or k reaches later rows of every head; the values' NaN follow the rule.
    mask, causal, attended = _masking("mask+causal", 20, 20)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, 20, D, generator=gen) for _ in range(3))
    {"q": q, "k": k, "v": v}[where][AT_B, 0, 6, AT_C] = float("nan")
    got = attention(q, k, v, "selective", mask=mask, causal=causal)
    ref = attention_reference(q, k, v, "selective", mask=mask, causal=causal).out
    assert torch.equal(got.isnan(), ref.isnan())
    assert_close(got[~got.isnan()], ref[~ref.isnan()], rtol=1e-5, atol=1e-5)
    assert not got[1 - AT_B].isnan().any()
    if where == "v":
        want = torch.zeros_like(got, dtype=torch.bool)
        want[AT_B, 0, :, AT_C] = attended[:, 6]
        assert torch.equal(got.isnan(), want)
    else:  # the later rows of the other head too
        assert got[AT_B, 1, 7:].isnan().any() and not got[AT_B, 1, :6].isnan().any()


def test_sdpa_on_this_cpu_is_what_the_rule_documents():
    # The facts the rule's module doc states about SDPA's CPU flash kernel (torch 2.13): a NaN
    # query comes back as a zero row below one SIMD vector of keys and as NaN from there on; its
    # math backend spreads a hidden NaN key to every query.  If torch changes them, the doc must.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = torch.Generator().manual_seed(0)
    lanes = nans.flash_scalar_keys()
    known = lanes != nans.WIDEST_SIMD_FLOATS      # a capability whose vector width is known
    for n_k, nan_row in ((lanes - 1, False), (lanes, True))[0 if known else 1:]:
        q, k, v = (torch.randn(1, 1, n, 16, generator=gen) for n in (3, n_k, n_k))
        q[0, 0, 1, 0] = float("nan")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert bool(out[0, 0, 1].isnan().all()) == nan_row
        if not nan_row:
            assert torch.equal(out[0, 0, 1], torch.zeros(16))
        assert bool(attention(q, k, v)[0, 0, 1].isnan().all())
    q, k, v = (torch.randn(1, 1, 4, 16, generator=gen) for _ in range(3))
    k[0, 0, 3, 0] = float("nan")
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert bool(out.isnan().all())          # rows 0-2 cannot see key 3, and still get its NaN
    assert not attention(q, k, v, causal=True)[0, 0, :3].isnan().any()


def test_reach_gives_the_attending_rows():
    hit = torch.zeros(1, 1, 5, 2, dtype=torch.bool)
    hit[0, 0, 2, 1] = True
    causal = nans.reach(hit, None, True, 4)
    assert causal[0, 0, :, 1].tolist() == [False, False, True, True]
    assert not causal[..., 0].any()
    assert nans.reach(hit, None, False, 3)[0, 0, :, 1].all()
    mask = torch.tensor([[True, True, False, True, True], [False] * 5, [True] * 5])
    assert nans.reach(hit, mask, False, 3)[0, 0, :, 1].tolist() == [False, False, True]
    assert nans.reach(hit[..., :0, :], None, True, 3).shape == (1, 1, 3, 2)
