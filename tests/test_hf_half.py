"""A Hugging Face Llama after ``attnscale.hf.set_mechanism``, cast to fp16, bf16 and float64: the
swapped model's output against the same swapped model in float32, to a tolerance from the dtype's
rounding, tight enough that the native attention in its place fails it.

At init several mechanisms are the native ``scaled`` (a learned temperature at its start, yarn's
and mscale's factor 1, llama4-temp and logn below their lengths, clip-qkv and softcap far from
their bounds): each is built with options that make it act at these sizes, and its learned
parameters are moved away from their init, so that every case but ``scaled`` itself tells the
mechanism from the native temperature."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.testing import assert_close

from attnscale import hf
from attnscale.mechanisms import MECHANISMS
from attnscale.measure.monitor import monitor

# Those set_mechanism installs: defined at init, and none of the refused kinds (a forget gate or
# selection as a logit bias, differential attention's second map; attnscale.hf.layers).
HF_SWAPPABLE = [name for name, cls in MECHANISMS.items()
                if cls.defined_at_init and cls.logit_bias is None
                and cls.normaliser != "differential"]
DTYPES = [torch.float16, torch.bfloat16, torch.float64]
# Options under which a mechanism differs from scaled on 8 tokens of head size 8.
OPTIONS = {"softcap": {"cap": 0.5}, "yarn": {"factor": 16.0}, "mscale": {"factor": 16.0},
           "llama4-temp": {"floor_scale": 1, "attn_scale": 0.5}, "logn": {"train_len": 2},
           "clip-qkv": {"clip": 0.3}}
# Max |output - float32 output| in units of the dtype's eps (float32's for float64, the
# reference's own rounding): RMSNorm, attention and the MLP all round in the dtype, outputs are
# up to about 2.7.  Measured at most 7.6 eps (qknorm in bf16) over every mechanism; the native
# attention in place of a mechanism is at least 36 eps away (learned-temp in bf16).
EPS_TOLERANCE = 16


def _swapped(name: str):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      initializer_range=0.1)  # logits of a few units
    torch.manual_seed(0)
    native = transformers.LlamaModel(config).eval()
    model = copy.deepcopy(native)
    hf.set_mechanism(model, name, **OPTIONS.get(name, {}))
    moved = torch.Generator().manual_seed(2)
    with torch.no_grad():  # learned temperatures, gains and sinks away from their init
        for key, p in model.named_parameters():
            if "attnscale_mechanism" in key:
                p.add_(0.5 * torch.randn(p.shape, generator=moved))
    return native, model


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", HF_SWAPPABLE)
def test_hf_llama_cast_after_set_mechanism(name, dtype):
    native, model = _swapped(name)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).last_hidden_state.double()           # the swapped model, float32
        without = native(ids).last_hidden_state.double()
    cast = copy.deepcopy(model).to(dtype)
    with torch.no_grad(), monitor(cast) as mon:
        out = cast(ids).last_hidden_state
    assert len(mon.records) == 4 and all(r["entropy_mean"] >= 0 for r in mon.records)
    tol = EPS_TOLERANCE * torch.finfo(dtype if dtype != torch.float64 else torch.float32).eps
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert_close(out.double(), want, rtol=0.0, atol=tol)
    if name != "scaled":  # the check can fail: the native temperature is farther off
        assert float((without - want).abs().max()) > 2 * tol
