"""Soft-cap attention on FlexAttention (attnscale.kernels.flex), the CUDA path of
capped_attention, checked on the CPU.

FlexAttention runs eagerly on the CPU in this torch (it materialises the scores, forward only:
its CPU backward raises NotImplementedError), so the forward is compared with
attention_reference directly, and the gradients that the compiled CUDA kernel takes through the
score_mod are checked by differentiating the same score_mod applied to materialised scores.
Timing on a GPU: benchmarks/bench_mechanisms.py --device cuda.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from attnscale.attention import attention_reference
from attnscale.kernels import flex, softcap
from attnscale.mechanisms import build_mechanism

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, H, NQ, NK, D = 2, 3, 13, 17, 8
SCALE = D ** -0.5
MASKS = {
    "none": None,
    "(Nq, Nk)": (NQ, NK),
    "(B, 1, Nq, Nk)": (B, 1, NQ, NK),
    "(1, H, 1, Nk)": (1, H, 1, NK),
}
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


def _inputs(dtype, seed=0, nq=NQ, nk=NK):
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) * s).to(dtype)
                 for n, s in ((nq, 3.0), (nk, 3.0), (nk, 1.0)))


def _mask(shape, seed=1):
    if shape is None:
        return None
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.3
    mask[..., 0] = True  # every query keeps a key (capped_attention's contract)
    return mask


def test_flex_is_available_and_used_only_on_cuda():
    assert flex.available()
    assert not flex.usable(torch.zeros(1, 1, 1, 1))  # the CPU keeps the blockwise kernel


@pytest.mark.parametrize("cap", [1.0, 30.0, 1e6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("mask_shape", list(MASKS))
def test_flex_forward_matches_reference(cap, dtype, mask_shape):
    q, k, v = _inputs(dtype)
    mask = _mask(MASKS[mask_shape])
    mech = build_mechanism("softcap", D, H, cap=cap).to(dtype)
    out = flex.capped_attention(q, k, v, SCALE, cap, mask, False)
    ref = attention_reference(q, k, v, mech, mask=mask).out
    assert_close(out, ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("nq, nk", [(13, 13), (13, 17), (17, 13)])
def test_flex_causal_block_mask_matches_reference(dtype, nq, nk):
    # Top-left causality as a block mask, square and not.
    q, k, v = _inputs(dtype, nq=nq, nk=nk)
    mech = build_mechanism("softcap", D, H, cap=30.0).to(dtype)
    out = flex.capped_attention(q, k, v, SCALE, 30.0, None, True)
    assert_close(out, attention_reference(q, k, v, mech, causal=True).out, **TOLERANCE[dtype])


def test_half_values_are_computed_in_float32():
    q, k, v = _inputs(torch.float32)
    out = flex.capped_attention(q, k, v.to(torch.bfloat16), SCALE, 30.0, None, False)
    ref = flex.capped_attention(q, k, v.to(torch.bfloat16).float(), SCALE, 30.0, None, False)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref.to(torch.bfloat16))


def _materialised_score_mod(q, k, v, mask, cap):
    """softmax(score_mod(scale q kᵀ)) v with flex's score_mod applied to every (b, h, i, j)."""
    scores = (q @ k.transpose(-2, -1)) * SCALE
    b, h, i, j = (torch.arange(n).reshape([-1 if d == a else 1 for d in range(4)])
                  for a, n in enumerate(scores.shape))
    mod = flex.softcap_score_mod(torch.tensor(cap, dtype=q.dtype),
                                 None if mask is None else
                                 mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
                                 .expand(scores.shape))
    return torch.softmax(mod(scores, b, h, i, j), dim=-1) @ v


@pytest.mark.parametrize("cap", [1.0, 30.0, 1e6])
@pytest.mark.parametrize("mask_shape", ["none", "(B, 1, Nq, Nk)"])
def test_score_mod_gradients_match_reference(cap, mask_shape):
    # What flex's compiled backward differentiates is the score_mod: its gradients, through
    # materialised scores, against attention_reference in float64.
    q, k, v = (t.requires_grad_() for t in _inputs(torch.float64))
    mask = _mask(MASKS[mask_shape])
    mech = build_mechanism("softcap", D, H, cap=cap).double()
    out = _materialised_score_mod(q, k, v, mask, cap)
    ref = attention_reference(q, k, v, mech, mask=mask).out
    assert_close(out, ref, rtol=1e-12, atol=1e-13)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_capped_attention_dispatches_to_flex_where_usable(monkeypatch):
    # With flex usable (as on CUDA), capped_attention runs it: its result, not the blockwise one.
    calls, original = [], flex.capped_attention

    def spy(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(flex, "usable", lambda q: True)
    monkeypatch.setattr(softcap.flex, "capped_attention", spy)
    q, k, v = _inputs(torch.float32)
    out = softcap.capped_attention(q, k, v, SCALE, 30.0, None, True)
    mech = build_mechanism("softcap", D, H, cap=30.0)
    assert len(calls) == 1
    assert_close(out, attention_reference(q, k, v, mech, causal=True).out)


def test_flex_inside_an_outer_torch_compile_equals_eager():
    # The branch a compiled CUDA model takes: flex_attention traced by dynamo, the causal block
    # mask built inside the graph (aot_eager: no C++ toolchain needed).
    q, k, v = _inputs(torch.float32)
    compiled = torch.compile(lambda q, k, v: flex.capped_attention(q, k, v, SCALE, 30.0, None,
                                                                   True),
                             backend="aot_eager", fullgraph=True)
    assert_close(compiled(q, k, v), flex.capped_attention(q, k, v, SCALE, 30.0, None, True))
