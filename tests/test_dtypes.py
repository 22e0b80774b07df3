"""Every registry mechanism with its module cast to fp16, bf16 and float64: MultiHeadAttention, the
bare mechanism and a Hugging Face Llama after ``set_mechanism``, against a float64 twin."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from attnscale.attention import MultiHeadAttention
from attnscale.mechanisms import MECHANISMS, build_mechanism
from attnscale.measure.monitor import monitor

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


HF_SWAPPABLE = [name for name, cls in MECHANISMS.items()
                if cls.defined_at_init and cls.logit_bias is None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", HF_SWAPPABLE)
def test_hf_llama_cast_after_set_mechanism(name, dtype):
    import transformers  # in the test extra: never skipped
    from attnscale import hf

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).eval()
    hf.set_mechanism(model, name)
    twin = copy.deepcopy(model).to(torch.float64)
    model = model.to(dtype)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), monitor(model) as mon:
        out = model(ids).last_hidden_state
    with torch.no_grad():
        want = twin(ids).last_hidden_state
    assert len(mon.records) == 4 and all(r["entropy_mean"] >= 0 for r in mon.records)
    tol = TOL[dtype] * 5  # RMSNorm and the MLP round in the dtype too
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert_close(out.double(), want, rtol=tol, atol=tol)


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
