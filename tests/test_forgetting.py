"""Forgetting Attention (FoX, arXiv 2503.02130) against its formula written out in float64: values
and gradients of q, k, v, the log forget gates and W_f, masks, causal Nq != Nk, an all-masked row,
one key, fp16 / bf16 / float64, the fused paths (the SDPA fold, the blockwise kernel, and the
CUDA path's FlexAttention score_mod checked on the CPU) and float32's precision far down a
sequence."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from attnscale.attention import MultiHeadAttention, attention
from attnscale.errors import ConfigError
from attnscale.kernels import flex
from attnscale.kernels.biased import ForgetBias, biased_attention
from attnscale.mechanisms import build_mechanism
from attnscale.stats import row_stats
from mechanism_inputs import (B, D, H, assert_lower_precision, grads, nan_rows, observed_rows,
                              qkv, random_mask)


def fox_reference(q, k, v, log_f, mask=None):
    """softmax(q kᵀ/√d + D) v with D_ij = Σ_{j<l≤i} log f_l, causal (top-left), written as an
    explicit sum over the positions l strictly after the key and up to the query; a row with no
    key gives 0.  All float64."""
    n_q, n_k, n = q.shape[-2], k.shape[-2], log_f.shape[-1]
    i = torch.arange(n_q).view(-1, 1, 1)
    j = torch.arange(n_k).view(1, -1, 1)
    pos = torch.arange(n).view(1, 1, -1)
    between = ((pos > j) & (pos <= i)).to(log_f.dtype)                    # (Nq, Nk, N)
    decay = torch.einsum("ijl,bhl->bhij", between, log_f)
    z = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + decay
    keep = torch.ones(n_q, n_k, dtype=torch.bool).tril()
    if mask is not None:
        keep = keep & mask
    p = torch.softmax(z.masked_fill(~keep, -math.inf), dim=-1)
    return torch.where(keep.any(-1, keepdim=True), p, 0.0) @ v


def _inputs(n_q, n_k, dtype=torch.float64, seed=0):
    """q, k, v and log forget gates (B, H, max(Nq, Nk)), requiring gradients."""
    gen = torch.Generator().manual_seed(seed + 100)
    log_f = F.logsigmoid(torch.randn(B, H, max(n_q, n_k), generator=gen, dtype=dtype))
    return [*qkv(n_q, n_k, dtype, seed), log_f.requires_grad_()]


@pytest.mark.parametrize("n_q, n_k", [(6, 6), (5, 7), (7, 5), (4, 1)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("path", ["pipeline", "trace", "blockwise"])
def test_fox_matches_its_formula_in_float64(n_q, n_k, masked, path):
    q, k, v, log_f = _inputs(n_q, n_k)
    mask = random_mask(n_q, n_k) if masked else None
    mech = build_mechanism("forgetting", D, H).double()
    want = fox_reference(q, k, v, log_f, mask)
    if path == "blockwise":  # the kernel itself, every row given a key as the pipeline does
        keep, causal = _kernel_mask(mask, n_q, n_k)
        got = biased_attention(q, k, v, D ** -0.5, ForgetBias(torch.cumsum(log_f, -1)), keep,
                               causal) * _has_keys(mask, n_q, n_k)
        want = fox_reference(q, k, v, log_f, mask)
    else:
        got = attention(q, k, v, mech, causal=True, mask=mask, log_forget=log_f,
                        trace=path == "trace")
        got = got.out if path == "trace" else got
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads(got, (q, k, v, log_f)), grads(want, (q, k, v, log_f))):
        assert_close(a, b, rtol=1e-10, atol=1e-12)


def _has_keys(mask, n_q, n_k):
    """1 on the rows the mask leaves a key under causality, 0 on the others: (B|1, 1, Nq, 1)."""
    if mask is None:
        return 1.0
    return (mask & torch.ones(n_q, n_k, dtype=torch.bool).tril()).any(-1, keepdim=True)


def _kernel_mask(mask, n_q, n_k):
    """What the pipeline hands a kernel: causality alone, or the mask with causality folded in
    and a row without keys attending every key (its output is zeroed afterwards)."""
    if mask is None:
        return None, True
    keep = mask & torch.ones(n_q, n_k, dtype=torch.bool).tril()
    return keep | ~keep.any(-1, keepdim=True), False


@pytest.mark.parametrize("n_q, n_k", [(6, 6), (5, 7), (7, 5)])
@pytest.mark.parametrize("masked", [False, True])
def test_flex_score_mod_is_the_bias(n_q, n_k, masked):
    """The CUDA path's score_mod, checked on the CPU: applied to every score at once (index
    tensors broadcast as FlexAttention's are), it gives the formula's logits and passes the
    gradient on to c's low half; and FlexAttention run eagerly gives the formula's output
    (FlexAttention has no CPU backward)."""
    q, k, v, log_f = _inputs(n_q, n_k)
    mask = random_mask(n_q, n_k) if masked else None
    keep, causal = _kernel_mask(mask, n_q, n_k)
    c = torch.cumsum(log_f.float().double(), -1)                  # float64 c, float32 halves
    hi = c.detach().float()
    lo = (c - hi.double()).float()
    score = (q @ k.transpose(-2, -1)).float() / math.sqrt(D)
    at = (torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1),
          torch.arange(n_q).view(1, 1, -1, 1), torch.arange(n_k).view(1, 1, 1, -1))
    full = None if keep is None else keep.expand(B, H, n_q, n_k)
    z = flex.forget_score_mod(hi, lo, full)(score, *at)
    want = score.double() + c[..., :n_q, None] - c[..., None, :n_k]      # every pair's bias
    if full is not None:
        want = want.masked_fill(~full, -math.inf)
    assert_close(z.double(), want, rtol=0, atol=2e-6)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(2)).masked_fill(
        ~torch.isfinite(z), 0.0)
    (d_c,) = torch.autograd.grad(z, c, g)
    g64 = g.double()
    want_dc = torch.zeros_like(c)
    want_dc[..., :n_q] += g64.sum(-1)
    want_dc[..., :n_k] -= g64.sum(-2)
    assert_close(d_c, want_dc, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        out = flex.forget_attention(*(t.float() for t in (q, k, v)), D ** -0.5, c, keep, causal)
    assert_close(out.double() * _has_keys(mask, n_q, n_k),
                 fox_reference(q, k, v, log_f.float().double(), mask), rtol=0, atol=2e-6)


def test_an_all_masked_row_gives_zero_output_and_gradients():
    q, k, v, log_f = _inputs(6, 6)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 3, :] = False
    out = attention(q, k, v, build_mechanism("forgetting", D, H).double(), causal=True,
                    mask=mask, log_forget=log_f)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    dq, = torch.autograd.grad(out.sum(), q)
    assert torch.equal(dq[:, :, 3], torch.zeros_like(dq[:, :, 3]))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2),
                                        (torch.float16, 4e-3)])
def test_fox_in_lower_precision(dtype, tol):
    q, k, v, log_f = _inputs(9, 9)
    want = fox_reference(q, k, v, log_f)
    mech = build_mechanism("forgetting", D, H).to(dtype)
    args = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, log_f)]
    got = attention(*args[:3], mech, causal=True, log_forget=args[3])
    assert_lower_precision(got, args, want, (q, k, v, log_f), dtype, tol)


def test_float32_keeps_its_precision_far_down_the_sequence():
    # 3000 tokens of strong forgetting: c falls to about -3000.  A single folded channel -c_j
    # would round every logit at ulp(3000) = 2.4e-4; the split channels keep SDPA's precision.
    n, d = 3000, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    log_f = -torch.rand(1, 1, n, generator=gen, dtype=torch.float64) * 2.0
    z = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    c = torch.cumsum(log_f, -1)
    z = (z + c[..., :, None] - c[..., None, :]).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    want = torch.softmax(z, -1) @ v                                        # float64
    mech = build_mechanism("forgetting", d, 1)
    got = attention(q.float(), k.float(), v.float(), mech, causal=True, log_forget=log_f.float())
    plain = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    plain_err = (plain.double() - torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(d))
                 .masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf), -1)
                 @ v).abs().max()
    assert (got.double() - want).abs().max() < 10 * plain_err


def test_forget_gates_come_from_the_layer_input_in_multi_head_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(H * D, H, "forgetting", dtype=torch.float64)
    x = torch.randn(B, 7, H * D, dtype=torch.float64, requires_grad=True)
    out = mha(x, causal=True)
    split = lambda t: t.view(B, 7, H, D).transpose(1, 2)  # noqa: E731
    log_f = F.logsigmoid(mha.mechanism.w_f(x)).transpose(1, 2)            # (B, H, N)
    o = fox_reference(split(mha.w_q(x)), split(mha.w_k(x)), split(mha.w_v(x)), log_f)
    want = mha.w_o(o.transpose(1, 2).reshape(B, 7, H * D))
    assert_close(out, want, rtol=1e-12, atol=1e-12)
    wrt = (x, mha.mechanism.w_f.weight, mha.mechanism.w_f.bias)
    for a, b in zip(grads(out, wrt), grads(want, wrt)):
        assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fox_refuses_what_it_is_not():
    q, k, v, log_f = _inputs(5, 5)
    mech = build_mechanism("forgetting", D, H).double()
    with pytest.raises(ConfigError, match="causal=True"):
        attention(q, k, v, mech, log_forget=log_f)
    with pytest.raises(ConfigError, match=r"max\(Nq, Nk\)"):
        attention(q, k, v, mech, causal=True, log_forget=log_f[..., :4])
    with pytest.raises(ConfigError, match="no forget gate"):
        attention(q, k, v, build_mechanism("scaled", D, H), causal=True, log_forget=log_f)
    with pytest.raises(ConfigError, match="layer's input"):
        build_mechanism("forgetting", D, H).forget_gates(torch.randn(1, 5, H * D))
    # without gates (a bare module) FoX is scaled attention
    assert_close(mech(q, k, v, causal=True),
                 attention(q, k, v, build_mechanism("scaled", D, H), causal=True))


def test_the_monitor_sees_the_biased_logits():
    q, k, v, log_f = (t.detach() for t in _inputs(7, 7))
    mech = build_mechanism("forgetting", D, H).double()
    rows = observed_rows(lambda: attention(q, k, v, mech, causal=True, log_forget=log_f))
    trace = attention(q, k, v, mech, causal=True, log_forget=log_f, trace=True)
    z = trace.logits.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), -math.inf)
    assert_close(rows, row_stats(z))


@pytest.mark.parametrize("where", ["q", "k", "v", "log_f"])
def test_a_nan_reaches_the_rows_whose_logits_it_enters(where):
    mech = build_mechanism("forgetting", D, H).double()
    log_f = _inputs(6, 6)[3].detach()
    if where == "log_f":  # the gate of token 2: every c from there on
        log_f[0, 0, 2] = math.nan
    inputs = where if where != "log_f" else "none"

    def run(trace):
        return lambda q, k, v: attention(q, k, v, mech, causal=True, log_forget=log_f,
                                         trace=trace)

    fused = nan_rows(run(False), inputs)
    assert fused == nan_rows(lambda *a: run(True)(*a).out, inputs)
    # the NaN rule (attnscale.kernels.nans): a query's own row, a key's or value's later rows
    assert fused == ([i == 2 for i in range(6)] if where == "q" else [i >= 2 for i in range(6)])


def test_the_blockwise_kernel_on_worker_threads(monkeypatch):
    # the CUDA path without FlexAttention: batch elements side by side, c's gradient gathered
    import attnscale.kernels.biased as biased
    from attnscale.workers import num_threads
    monkeypatch.setattr(biased, "BIASED_BLOCK_ELEMENTS", H * 30 * 4)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(6, H, 30, D, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    log_f = F.logsigmoid(torch.randn(6, H, 30, generator=gen, dtype=torch.float64))
    log_f.requires_grad_()
    with num_threads(2):
        got = biased_attention(q, k, v, D ** -0.5, ForgetBias(torch.cumsum(log_f, -1)), None,
                               True)
        got_grads = grads(got, (q, k, v, log_f))
    want = fox_reference(q, k, v, log_f)
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, grads(want, (q, k, v, log_f))):
        assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_second_backward_through_the_same_graph_gives_the_same_gradients():
    # the blockwise kernel (the CPU path without a mask) zeroes c's gradient afresh each backward
    q, k, v, log_f = _inputs(6, 6, dtype=torch.float32)
    out = attention(q, k, v, build_mechanism("forgetting", D, H), causal=True, log_forget=log_f)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    first = [t.clone() for t in torch.autograd.grad(out, (q, k, v, log_f), g, retain_graph=True)]
    second = torch.autograd.grad(out, (q, k, v, log_f), g)  # c's into the memory freed just now
    for a, b in zip(first, second):
        assert torch.equal(a, b)
