"""Every registry mechanism with its module cast to fp16, bf16 and float64: MultiHeadAttention and
the bare mechanism, against a float64 twin (a Hugging Face Llama after ``set_mechanism``:
test_hf_half.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from attnscale.attention import MultiHeadAttention
from attnscale.mechanisms import MECHANISMS, build_mechanism

DTYPES = [torch.float16, torch.bfloat16, torch.float64]
# Output tolerance against the float64 twin: inputs and weights are rounded to the dtype, the
# products accumulate in float32 (half types) or float64.
TOL = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float64: 1e-10}
D_MODEL, HEADS, N = 16, 2, 6


def _x(dtype, shape=(2, N, D_MODEL), seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _check(out, want, dtype):
    assert out.dtype == dtype
    assert bool(torch.isfinite(out).all())
    tol = TOL[dtype]
    assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(MECHANISMS))
def test_multihead_attention_cast(name, dtype):
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, HEADS, name).train(False)
    twin = copy.deepcopy(mha).to(torch.float64)
    mha = mha.to(dtype)
    x = _x(dtype).requires_grad_()
    out = mha(x, causal=True)
    _check(out, twin(x.detach().double(), causal=True), dtype)
    out.float().square().sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype and bool(torch.isfinite(x.grad).all())
    for p in mha.parameters():
        assert p.grad is None or (p.grad.dtype == dtype and bool(torch.isfinite(p.grad).all()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(MECHANISMS))
def test_bare_mechanism_cast(name, dtype):
    mech = build_mechanism(name, D_MODEL // HEADS, HEADS)
    twin = copy.deepcopy(mech).to(torch.float64)
    mech = mech.to(dtype)
    q, k, v = (_x(dtype, (2, HEADS, N, D_MODEL // HEADS), seed) for seed in range(3))
    mask = torch.rand(N, N, generator=torch.Generator().manual_seed(3)) > 0.3
    out = mech(q, k, v, mask=mask)
    _check(out, twin(q.double(), k.double(), v.double(), mask=mask), dtype)
    assert mech.logits(q, k).dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(MECHANISMS))
def test_multihead_attention_bf16_autocast(name, training):
    """float32 weights under CPU bf16 autocast (the LM's --bf16): forward and backward run, the
    output matches the float32 module at bf16 tolerance, gradients stay float32 and finite."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, HEADS, name).train(training)
    twin = copy.deepcopy(mha)
    x = _x(torch.float32).requires_grad_()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = mha(x, causal=True)
    want = twin(x.detach(), causal=True)
    tol = TOL[torch.bfloat16]
    assert_close(out.float(), want, rtol=tol, atol=tol)
    out.float().square().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert bool(torch.isfinite(x.grad).all())
    grads = [p.grad for p in mha.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
