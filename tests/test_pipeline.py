"""The one attention pipeline: every entry point runs it, its trace, and its observer hook."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import attnscale
from attnscale import pipeline
from attnscale.attention import (MultiHeadAttention, Observation, add_observer, attention,
                                 attention_reference, observe, observers)
from attnscale.errors import ConfigError
from attnscale.mechanisms import MECHANISMS, build_mechanism

attention_module = importlib.import_module("attnscale.attention")
B, H, NQ, NK, D = 2, 3, 5, 7, 8


def _qkv(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=gen, dtype=dtype) for n in (NQ, NK, NK))


def _mask(seed=1):
    return torch.rand(NQ, NK, generator=torch.Generator().manual_seed(seed)) > 0.4


class Recorder:
    def __init__(self):
        self.seen: list[Observation] = []

    def __call__(self, obs: Observation) -> None:
        self.seen.append(obs)


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_the_trace_is_the_same_pipeline_materialised(name):
    mech = build_mechanism(name, D, H).double()
    q, k, v = _qkv()
    for mask, causal in ((None, False), (None, True), (_mask(), True)):
        trace = attention(q, k, v, mech, mask=mask, causal=causal, trace=True)
        assert isinstance(trace, pipeline.AttentionTrace)
        assert_close(trace.out, attention(q, k, v, mech, mask=mask, causal=causal))
        ref = attention_reference(q, k, v, mech, mask=mask, causal=causal)
        for field in ("logits", "weights", "out"):
            assert torch.equal(getattr(trace, field), getattr(ref, field)), field
        if (mech.per_key and mech.logit_bias is None) or (mask is None and not causal):
            # A row-adaptive rule (not per_key) and a selection read the mask, which the
            # logits() here are not given.
            assert_close(trace.logits, mech.logits(q, k, pipeline.key_counts(mask, causal, q, k)))


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_every_entry_point_reaches_the_observer_with_the_prepared_q_and_k(name):
    mech = build_mechanism(name, D, H).double()
    q, k, v = _qkv()
    mask = _mask()
    rec = Recorder()
    with observe(rec):
        attention(q, k, v, mech, mask=mask, causal=True)     # the public function
        mech(q, k, v, causal=True)                            # the bare mechanism
    assert len(rec.seen) == 2 and rec not in observers()
    first, second = rec.seen
    n_keys = pipeline.key_counts(mask, True, q, k)
    qs, ks, scale, _ = pipeline.apply_rule(mech, q, k, n_keys, pipeline.key_mask(mask, True, q, k),
                                           True)
    assert_close(first.q, qs)
    assert_close(first.k, ks)
    assert_close(torch.as_tensor(first.scale, dtype=torch.float64),
                 torch.as_tensor(scale, dtype=torch.float64))
    assert first.cap == mech.cap and first.mechanism is mech
    assert first.mask is mask and first.causal and torch.equal(first.n_keys, n_keys)
    assert second.mask is None and second.causal
    assert torch.equal(second.n_keys, pipeline.causal_counts(NQ, NK))


def test_multihead_attention_and_the_logits_reach_the_pipeline():
    mha = MultiHeadAttention(12, 3, "qknorm", dtype=torch.float64)
    x = torch.randn(2, 4, 12, dtype=torch.float64)
    rec = Recorder()
    with observe(rec):
        mha(x, causal=True)
    assert len(rec.seen) == 1
    # The observer's q is the mechanism's: unit rows times g.
    assert_close(rec.seen[0].q.norm(dim=-1), mha.mechanism.g.detach().expand(2, 3, 4))


def test_observers_are_context_local_and_removed_on_error():
    q, k, v = _qkv()
    rec = Recorder()
    with pytest.raises(RuntimeError, match="body"):
        with observe(rec):
            other = []
            thread = threading.Thread(target=lambda: other.append(attention(q, k, v)))
            thread.start()
            thread.join()
            assert other and rec.seen == []   # another thread's call is not this context's
            raise RuntimeError("body")
    assert observers() == ()
    attention(q, k, v)
    assert rec.seen == []


def test_an_observer_error_propagates_and_handles_remove_once():
    def broken(obs):
        raise ValueError("observer failed")

    handle = add_observer(broken)
    try:
        with pytest.raises(ValueError, match="observer failed"):
            attention(*_qkv())
        with pytest.raises(ConfigError, match="already registered"):
            add_observer(broken)
    finally:
        handle.remove()
    handle.remove()
    assert observers() == ()
    with pytest.raises(ConfigError, match="observer must be callable"):
        add_observer(3)


def test_running_marks_the_pipeline_s_own_kernel_calls():
    calls = []
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(pipeline.running())
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        q, k, v = _qkv(dtype=torch.float32)
        attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v)
    finally:
        F.scaled_dot_product_attention = original
    assert calls == [True, False] and not pipeline.running()


def test_trace_flag_is_a_bool():
    with pytest.raises(ConfigError, match="trace"):
        attention(*_qkv(), trace="yes")


def test_the_public_names_still_work():
    assert attnscale.attention is attention_module.attention
    assert attention_module.attention_reference is attention_reference
    assert attnscale.attention_reference is attention_reference
    assert callable(attnscale.build_mechanism) and "scaled" in attnscale.MECHANISMS
    assert isinstance(attnscale.MultiHeadAttention(8, 2), torch.nn.Module)
