"""Selective attention (arXiv 2410.02703) against its formula written out in float64: values and
gradients of q, k and v (the selection's gradient reaches the first head's q and k), masks,
causal and not, Nq != Nk, an all-masked row, one key, several blocks of queries (the carry from
block to block), fp16 / bf16 / float64, and the statistics the monitor takes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import attnscale.kernels.biased as biased
from attnscale.attention import MultiHeadAttention, attention
from attnscale.errors import ConfigError
from attnscale.mechanisms import build_mechanism
from attnscale.stats import row_stats
from mechanism_inputs import (B, D, H, assert_lower_precision, grads, observed_rows, qkv,
                              random_mask)


def selective_reference(q, k, v, mask=None, causal=True, budget=None):
    """softmax(q kᵀ/√d − F) v with F_ij = Σ_{j<k<i} max(0, z⁰_kj), z⁰ the first head's logits,
    S_kj counted for keys 1 <= j < k that query k attends (the first head's mask), written as an
    explicit sum over the tokens k strictly between key and query; a row with no key gives 0."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    z0 = q[:, 0] @ k[:, 0].transpose(-2, -1) / math.sqrt(q.shape[-1])   # (B, Nq, Nk)
    kk = torch.arange(n_q).view(-1, 1)
    jj = torch.arange(n_k).view(1, -1)
    valid = (jj < kk) & (jj >= 1)
    if mask is not None:
        valid = valid & mask[:, 0]
    sel = torch.where(valid, z0.clamp(min=0.0), 0.0)                    # S (B, Nq, Nk)
    i = torch.arange(n_q).view(-1, 1, 1)
    k_ = torch.arange(n_q).view(1, -1, 1)
    j = torch.arange(n_k).view(1, 1, -1)
    between = ((k_ > j) & (k_ < i)).to(q.dtype)                          # (i, k, j)
    f = torch.einsum("ikj,bkj->bij", between, sel)
    z = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - f[:, None]
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    keep = keep.tril() if causal else keep
    if mask is not None:
        keep = keep & mask
    keep = keep.expand(z.shape)
    if budget is not None:  # each row keeps its `budget` least-selected keys, ties: most recent
        kept = torch.zeros_like(keep)
        for idx in torch.cartesian_prod(*(torch.arange(n) for n in z.shape[:-1])):
            b, h, i = idx.tolist()
            attended = [j for j in range(n_k) if keep[b, h, i, j]]
            best = sorted(attended, key=lambda j: (float(f[b, i, j]), -j))[:budget]
            kept[b, h, i, best] = True
        keep = kept
    p = torch.softmax(z.masked_fill(~keep, -math.inf), dim=-1)
    return torch.where(keep.any(-1, keepdim=True), p, 0.0) @ v




@pytest.mark.parametrize("n_q, n_k", [(6, 6), (5, 7), (7, 5), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("trace", [False, True])
def test_selective_matches_its_formula_in_float64(n_q, n_k, causal, masked, trace):
    q, k, v = qkv(n_q, n_k)
    mask = random_mask(n_q, n_k, heads=H) if masked else None
    mech = build_mechanism("selective", D, H).double()
    got = attention(q, k, v, mech, mask=mask, causal=causal, trace=trace)
    got = got.out if trace else got
    want = selective_reference(q, k, v, mask, causal)
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
        assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n_q, n_k", [(37, 37), (30, 45), (45, 30)])
def test_blocks_carry_the_selection_from_one_to_the_next(monkeypatch, n_q, n_k):
    # blocks of 7 queries: the column sums of S cross block boundaries forward, F's gradient
    # crosses them backward
    monkeypatch.setattr(biased, "BIASED_BLOCK_ELEMENTS", H * max(n_q, n_k) * 7)
    q, k, v = qkv(n_q, n_k, seed=4)
    mask = random_mask(n_q, n_k)
    mech = build_mechanism("selective", D, H).double()
    for causal in (True, False):
        got = attention(q, k, v, mech, mask=mask, causal=causal)
        want = selective_reference(q, k, v, mask, causal)
        assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
            assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_selection_flows_only_into_the_first_head_and_only_forward():
    q, k, v = qkv(8, 8)
    mech = build_mechanism("selective", D, H).double()
    out = attention(q, k, v, mech, causal=True)
    plain = attention(q, k, v, build_mechanism("scaled", D, H).double(), causal=True)
    # the first two rows see no token between a key and themselves: F = 0 there
    assert_close(out[:, :, :2], plain[:, :, :2], rtol=1e-13, atol=1e-13)
    # a head other than the first leaves the selection alone
    dq_plain = torch.autograd.grad(plain[:, 1].sum(), q)[0]
    dq = torch.autograd.grad(out[:, 1].sum(), q)[0]
    assert dq[:, 0].abs().sum() > 0 and dq_plain[:, 0].abs().sum() == 0
    assert_close(dq[:, 2], dq_plain[:, 2])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2),
                                        (torch.float16, 4e-3)])
def test_selective_in_lower_precision(dtype, tol):
    q, k, v = qkv(9, 9)
    want = selective_reference(q, k, v)
    mech = build_mechanism("selective", D, H).to(dtype)
    args = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    assert_lower_precision(attention(*args, mech, causal=True), args, want, (q, k, v), dtype, tol)


def test_an_all_masked_row_gives_zero_output_and_gradients():
    q, k, v = qkv(6, 6)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 3, :] = False
    out = attention(q, k, v, build_mechanism("selective", D, H).double(), causal=True, mask=mask)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    (dq,) = torch.autograd.grad(out[:, :, 3].sum(), q)
    assert torch.equal(dq, torch.zeros_like(dq))


def test_a_nan_reaches_the_rows_whose_logits_it_enters():
    q, k, v = (t.detach() for t in qkv(6, 6))
    q[0, 0, 2, 0] = math.nan           # the first head's query 2 selects: rows 3.. of every head
    out = attention(q, k, v, build_mechanism("selective", D, H).double(), causal=True)
    assert out[0, :, 3:].isnan().all() and not out[0, 1:, :2].isnan().any()
    assert out[0, 0, 2].isnan().all() and not out[1].isnan().any()


def test_the_monitor_sees_the_biased_logits():
    q, k, v = (t.detach() for t in qkv(7, 7))
    mech = build_mechanism("selective", D, H).double()
    rows = observed_rows(lambda: attention(q, k, v, mech, causal=True))
    trace = attention(q, k, v, mech, causal=True, trace=True)
    z = trace.logits.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), -math.inf)
    assert_close(rows, row_stats(z))


def test_selective_in_multi_head_attention_and_refusals():
    torch.manual_seed(0)
    mha = MultiHeadAttention(H * D, H, "selective", dtype=torch.float64)
    x = torch.randn(B, 7, H * D, dtype=torch.float64)
    split = lambda t: t.view(B, 7, H, D).transpose(1, 2)  # noqa: E731
    o = selective_reference(split(mha.w_q(x)), split(mha.w_k(x)), split(mha.w_v(x)))
    assert_close(mha(x, causal=True), mha.w_o(o.transpose(1, 2).reshape(B, 7, H * D)))
    from attnscale import hf
    with pytest.raises(ConfigError, match="KV cache"):
        hf.check_swappable("selective")


def test_the_guard_records_the_biased_logits_and_refuses_qk_clip():
    import attnscale
    torch.manual_seed(0)
    mha = MultiHeadAttention(H * D, H, "selective", dtype=torch.float64)
    x = torch.randn(B, 7, H * D, dtype=torch.float64)
    with attnscale.guard(mha) as g:
        mha(x, causal=True)
        g.step(0)
    split = lambda t: t.view(B, 7, H, D).transpose(1, 2)  # noqa: E731
    z = attention(split(mha.w_q(x)), split(mha.w_k(x)), split(mha.w_v(x)), mha.mechanism,
                  causal=True, trace=True).logits
    z = z.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), -math.inf)
    assert [r["logit_max"] for r in g.records] == pytest.approx(z.amax((0, 2, 3)).tolist())
    for name in ("selective", "forgetting", "differential"):
        with pytest.raises(ConfigError, match="logit bias or splits q and k") as err:
            attnscale.guard(MultiHeadAttention(16, 2, name), qk_clip=10.0)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("budget", [1, 3])
def test_context_pruning_keeps_the_least_selected_keys(monkeypatch, budget):
    # the selection head's mask is also every other head's here: pruning is per row
    monkeypatch.setattr(biased, "BIASED_BLOCK_ELEMENTS", H * 12 * 5)
    q, k, v = qkv(12, 12, seed=5)
    mask = random_mask(12, 12)
    mech = build_mechanism("selective", D, H, budget=budget).double()
    for trace in (False, True):
        got = attention(q, k, v, mech, mask=mask, causal=True, trace=trace)
        got = got.out if trace else got
        want = selective_reference(q, k, v, mask, True, budget)
        assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads(got, (q, k, v)), grads(want, (q, k, v))):
            assert_close(a, b, rtol=1e-10, atol=1e-12)
    with pytest.raises(ConfigError, match="budget"):
        build_mechanism("selective", D, H, budget=0)


def test_batch_elements_on_worker_threads_keep_their_own_selection(monkeypatch):
    # several batch elements run side by side, each carrying its own state from block to block
    from attnscale.workers import num_threads
    monkeypatch.setattr(biased, "BIASED_BLOCK_ELEMENTS", H * 30 * 4)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(6, H, 30, D, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    mech = build_mechanism("selective", D, H, budget=5).double()
    with num_threads(2):
        got = attention(q, k, v, mech, causal=True)
        dq, dk, dv = grads(got, (q, k, v))
    want = selective_reference(q, k, v, None, True, 5)
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip((dq, dk, dv), grads(want, (q, k, v))):
        assert_close(a, b, rtol=1e-10, atol=1e-12)
