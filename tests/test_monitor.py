"""attnscale.monitor: statistics against materialised float64 references, taps and hooks, records.

The Hugging Face side (native outputs, eager entropies, the CLI) is in test_hf.py.
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import attnscale
from attnscale.kernels import native
from attnscale.attention import MultiHeadAttention, attention_reference, key_mask
from attnscale.mechanisms import MECHANISMS, build_mechanism
from attnscale.errors import ConfigError
from attnscale.measure.monitor import (MASKED_BIAS, RECORD_KEYS, SCALAR_KEYS, Call, Monitor,
                                       Totals, Watch, colour_limits, head_stats, layer_summary,
                                       monitor, plot_entropy)
from attnscale import pipeline, stats
from attnscale.kernels import softcap
from attnscale.stats import logit_std, softmax_stats
from normalisers import lam_of, reference_distribution_stats, sink_of

# By module name: ``attnscale.attention`` is also the re-exported function.
attention_module = importlib.import_module("attnscale.attention")
ORIGINAL_SDPA = F.scaled_dot_product_attention
ORIGINAL_ATTENTION = attention_module.attention


def reference(z: torch.Tensor, keep: torch.Tensor, mechanism=None) -> dict[str, torch.Tensor]:
    """Per-head record statistics from materialised logits z (B, H, Nq, Nk) and a bool mask,
    under the mechanism's normaliser (softmax when None)."""
    normaliser = "softmax" if mechanism is None else mechanism.normaliser
    # differential: z holds two maps side by side, each over the keys
    wide = normaliser == "differential"
    keep = keep.expand(*z.shape[:-1], z.shape[-1] // 2 if wide else z.shape[-1])
    keep_z = torch.cat([keep, keep], -1) if wide else keep
    z = z.double().masked_fill(~keep_z, -math.inf)
    ok = keep.any(-1)                                     # rows with a key, (B, H, Nq)
    if normaliser == "softmax":  # the stable formulation: near one-hot rows keep their digits
        s = {**softmax_stats(z), "mass": ok.double()}
    else:
        s = reference_distribution_stats(z, keep, normaliser, sink_of(mechanism),
                                         lam_of(mechanism))
    n = ok.sum((0, 2)).double()

    def mean(x):
        return (x * ok).sum((0, 2)) / n

    return {"queries": n, "entropy_mean": mean(s["entropy"]),
            "entropy_min": torch.where(ok, s["entropy"], math.inf).amin((0, 2)),
            "max_weight_mean": mean(s["max_weight"]), "logit_std": mean(logit_std(z)),
            "logit_absmax": torch.where(keep_z, z.abs(), 0.0).amax((0, 2, 3)),
            "jacobian_fro_mean": mean(s["jacobian_fro"]), "mass_mean": mean(s["mass"]),
            "sink_mass_mean": mean(1 - s["mass"]) if normaliser == "sink" else 0.0 * n}


def assert_records_match(records: list[dict], ref: dict[str, torch.Tensor], atol=1e-5) -> None:
    for key, want in ref.items():
        got = torch.tensor([r[key] for r in records], dtype=torch.float64)
        torch.testing.assert_close(got, want.double(), atol=atol, rtol=1e-5, msg=key)


def assert_clean() -> None:
    """Nothing the monitor patches is left patched."""
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    assert attention_module.attention is ORIGINAL_ATTENTION
    assert attnscale.attention is ORIGINAL_ATTENTION


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ---------------------------------------------------------------------------------------------
# head_stats: the blockwise statistics against one materialised float64 computation

B, H, HK, NQ, NK, D = 2, 4, 2, 37, 45, 8


def _logits(q, k, scale, cap, bias):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    z = (q.double() @ k.double().transpose(-1, -2)) * (
        scale.double() if isinstance(scale, torch.Tensor) else scale)
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z if bias is None else z + bias.double()


def _case(name: str):
    """(head_stats kwargs, materialised logits, keep) for one masking situation."""
    gen = torch.Generator().manual_seed(0)
    q = 2 * torch.randn(B, H, NQ, D, generator=gen)
    k = torch.randn(B, HK, NK, D, generator=gen)   # grouped-query: 2 query heads per key head
    rows, cols = torch.arange(NQ).unsqueeze(-1), torch.arange(NK)
    kw = {"scale": 0.3, "cap": None, "mask": None, "causal": False}
    keep, bias = torch.ones(NQ, NK, dtype=torch.bool), None
    if name == "causal":
        kw["causal"], keep = True, cols <= rows
    elif name == "causal-bottom-right":
        kw.update(causal=True, causal_offset=NK - NQ)
        keep = cols <= rows + NK - NQ
    elif name == "causal-empty-rows":      # the first 5 queries have no key at all
        kw.update(causal=True, causal_offset=-5)
        keep = cols <= rows - 5
    elif name == "bool-mask-row-scale-cap":
        mask = torch.rand(B, 1, NQ, NK, generator=gen) > 0.4
        mask[0, 0, 3] = False                               # one empty row
        kw.update(scale=torch.rand(B, H, NQ, 1, generator=gen), cap=1.5, mask=mask, causal=True)
        keep = mask & (cols <= rows)
    elif name == "additive-bias":          # finite entries are logit biases, -inf masks
        bias = torch.randn(1, 1, NQ, NK, generator=gen)
        keep = torch.rand(1, 1, NQ, NK, generator=gen) > 0.3
        kw.update(scale=torch.rand(H, 1, 1, generator=gen), mask=bias.masked_fill(~keep, -math.inf))
        bias = bias.masked_fill(~keep, 0.0)
    elif name == "additive-finfo-min":     # HF's eager convention
        keep = torch.rand(NQ, NK, generator=gen) > 0.3
        kw.update(cap=2.0, mask=torch.where(keep, 0.0, torch.finfo(torch.float32).min))
    z = _logits(q, k, kw["scale"], kw["cap"], bias)
    return q, k, kw, z, keep


CASES = ["plain", "causal", "causal-bottom-right", "causal-empty-rows",
         "bool-mask-row-scale-cap", "additive-bias", "additive-finfo-min"]


@pytest.mark.parametrize("name", CASES)
def test_head_stats_match_materialised_reference(name, backend):
    q, k, kw, z, keep = _case(name)
    means = head_stats(q, k, block=5, **kw).means()
    records = [{key: means[key][h] for key in means} for h in range(H)]
    assert_records_match(records, reference(z, keep))


@pytest.mark.parametrize("name", CASES)
def test_blockwise_equals_unblocked(name, backend):
    q, k, kw, _, _ = _case(name)
    whole = head_stats(q, k, block=NQ, **kw)
    for block in (1, 7, 16):
        parts = head_stats(q, k, block=block, **kw)
        for field in ("queries", "entropy_sum", "entropy_min", "max_weight_sum", "logit_std_sum",
                      "logit_absmax", "jacobian_fro_sum"):
            torch.testing.assert_close(getattr(parts, field), getattr(whole, field),
                                       atol=1e-5, rtol=1e-6, msg=f"{field}, block {block}")


def test_near_one_hot_statistics_keep_their_relative_accuracy(backend):
    # Logit gaps of tens to hundreds: entropy and ||J|| are e^-gap small, and must come out with
    # relative accuracy, with no NaN.  The compiled kernel finishes each row in float64; the
    # PyTorch formulation works in float32, whose range ends at ~1e-38 (e^-87), below which a
    # value may flush to 0.
    atol = 0.0 if backend == "compiled" else torch.finfo(torch.float32).tiny
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 16, 8, generator=gen)
    k = torch.randn(1, 2, 40, 8, generator=gen)
    for scale in (3.0, 10.0, 30.0):
        got = head_stats(q, k, scale=scale, causal=True, causal_offset=24, block=5)
        z = _logits(q, k, scale, None, None)
        keep = torch.arange(40) <= torch.arange(16).unsqueeze(-1) + 24
        ref = reference(z, keep)
        n = ref["queries"]
        assert torch.isfinite(got.entropy_sum).all() and torch.isfinite(got.jacobian_fro_sum).all()
        torch.testing.assert_close(got.entropy_sum / n, ref["entropy_mean"], rtol=1e-4,
                                   atol=atol, msg=f"entropy, scale {scale}")
        torch.testing.assert_close(got.jacobian_fro_sum / n, ref["jacobian_fro_mean"], rtol=1e-4,
                                   atol=atol, msg=f"jacobian, scale {scale}")
        torch.testing.assert_close(got.entropy_min, ref["entropy_min"], rtol=1e-4, atol=atol,
                                   msg=f"entropy_min, scale {scale}")


def test_nan_logits_reach_the_record_of_their_head(backend):
    q = torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(0))
    k = q.clone()
    q[0, 1, 2, 0] = math.nan
    means = head_stats(q, k, causal=True, block=4).means()
    assert means["queries"] == [6, 6]
    for key in ("entropy_mean", "max_weight_mean", "logit_std", "jacobian_fro_mean"):
        assert math.isfinite(means[key][0]) and math.isnan(means[key][1]), key


def test_compiled_and_torch_backends_give_the_same_records(monkeypatch):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, "softcap", cap=2.0).eval()
    x = torch.randn(2, 70, 32)
    runs = {}
    for name in ("compiled", "torch"):
        monkeypatch.setenv(native.NATIVE_ENV, "1" if name == "compiled" else "0")
        native.library.cache_clear()
        with monitor(mha, block=16) as mon:
            mha(x, causal=True)
        runs[name] = mon.records
    monkeypatch.undo()
    native.library.cache_clear()
    assert [r["queries"] for r in runs["compiled"]] == [r["queries"] for r in runs["torch"]]
    for key in RECORD_KEYS[4:]:
        torch.testing.assert_close(torch.tensor([r[key] for r in runs["compiled"]]),
                                   torch.tensor([r[key] for r in runs["torch"]]),
                                   rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["causal", "bool-mask-row-scale-cap", "additive-bias"])
def test_blocks_in_parallel_give_the_serial_result(name, backend):
    # With several torch threads, head_stats spreads its blocks over worker threads; the
    # statistics must not depend on it (rows are reassembled in block order).
    q, k, kw, _, _ = _case(name)
    serial = head_stats(q, k, block=4, **kw)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        parallel = head_stats(q, k, block=4, **kw)
    finally:
        torch.set_num_threads(before)
    for field in ("queries", "entropy_sum", "entropy_min", "max_weight_sum", "logit_std_sum",
                  "logit_absmax", "jacobian_fro_sum"):
        torch.testing.assert_close(getattr(parallel, field), getattr(serial, field),
                                   rtol=1e-6, atol=1e-6, msg=field)


def test_masked_bias_threshold_is_what_softmax_ignores():
    # An additive entry at MASKED_BIAS gives weight exactly 0 next to any logit below 1e3.
    z = torch.tensor([1e3, 1e3 + MASKED_BIAS])
    assert torch.softmax(z, 0)[1].item() == 0.0


# ---------------------------------------------------------------------------------------------
# attnscale's MultiHeadAttention, for every mechanism in the registry

def _mha_qkv(mha: MultiHeadAttention, x: torch.Tensor):
    b, n, _ = x.shape

    def split(t):
        return t.view(b, n, mha.n_heads, mha.d_head).transpose(1, 2)  # (B, H, N, d)
    return split(mha.w_q(x)), split(mha.w_k(x)), split(mha.w_v(x))


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_monitor_on_multi_head_attention_every_mechanism(name):
    torch.manual_seed(0)
    # eval: sigma-reparam's power iteration would otherwise move W between the two forwards.
    mha = MultiHeadAttention(32, 4, name).eval()
    x = torch.randn(2, 24, 32)
    mask = torch.rand(2, 1, 24, 24) > 0.3
    mask[1, 0, 5] = False                        # a query with no key: not counted
    expected = mha(x, mask=mask, causal=True)
    with monitor(mha, block=5) as mon:
        out = mha(x, mask=mask, causal=True)
    assert torch.equal(out, expected)
    q, k, v = _mha_qkv(mha, x)
    trace = attention_reference(q, k, v, mha.mechanism, mask=mask, causal=True,
                                log_forget=mha._forget_gates(x, None, True))
    keep = key_mask(mask, True, q, k)
    with torch.no_grad():
        assert_records_match(mon.records, reference(trace.logits, keep, mha.mechanism))
    assert [r["module"] for r in mon.records] == ["MultiHeadAttention"] * 4
    assert [r["head"] for r in mon.records] == [0, 1, 2, 3]
    assert_clean()


@pytest.mark.parametrize("name", ["ssmax", "softcap"])
def test_causal_without_mask_matches_reference(name, backend):
    # No mask: the monitor counts each row's keys (ssmax's ln n) without an (N, N) mask.
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, name)
    x = torch.randn(2, 30, 32)
    with monitor(mha, block=4) as mon:
        mha(x, causal=True)
    q, k, v = _mha_qkv(mha, x)
    with torch.no_grad():
        trace = attention_reference(q, k, v, mha.mechanism, causal=True)
        assert_records_match(mon.records, reference(trace.logits, key_mask(None, True, q, k)))


def test_softcap_training_outputs_and_gradients_bit_identical():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, "softcap", cap=2.0)
    x = torch.randn(2, 40, 32, requires_grad=True)

    def run():
        out = mha(x, causal=True)
        grads = torch.autograd.grad(out.square().sum(), [x, *mha.parameters()])
        return out, grads

    out0, grads0 = run()
    with monitor(mha, block=8) as mon:
        out1, grads1 = run()
    assert torch.equal(out0, out1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert max(r["logit_absmax"] for r in mon.records) <= 2.0


def test_layers_numbered_in_call_order_and_named_by_module():
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.late = MultiHeadAttention(16, 2)
            self.early = MultiHeadAttention(16, 2, "qknorm")

        def forward(self, x):
            return self.late(self.early(x))

    model = Two()
    with monitor(model) as mon:
        model(torch.randn(1, 6, 16))
    assert [(r["layer"], r["module"], r["head"]) for r in mon.records] == [
        (0, "early", 0), (0, "early", 1), (1, "late", 0), (1, "late", 1)]
    assert list(mon.records[0]) == list(RECORD_KEYS)
    summary = layer_summary(mon.records)
    assert [row["module"] for row in summary] == ["early", "late"]
    assert summary[0]["heads"] == 2


# ---------------------------------------------------------------------------------------------
# The SDPA fallback, for modules that are not attnscale's

class SDPAModule(nn.Module):
    """Grouped-query attention written directly against F.scaled_dot_product_attention."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.qkv = nn.Linear(16, 4 * 8 + 2 * 2 * 8)  # 4 query heads, 2 key/value heads, d = 8

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([32, 16, 16], dim=-1)
        q = q.view(b, n, 4, 8).transpose(1, 2)           # (B, 4, N, 8)
        k = k.view(b, n, 2, 8).transpose(1, 2)           # (B, 2, N, 8)
        v = v.view(b, n, 2, 8).transpose(1, 2)
        kw = {"enable_gqa": True, "scale": 0.5}
        if self.mode == "causal":
            kw["is_causal"] = True
        elif self.mode == "bool":
            kw["attn_mask"] = self.keep
        elif self.mode == "additive":
            kw["attn_mask"] = torch.where(self.keep, self.bias, -math.inf)
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        self.q, self.k = q.detach(), k.detach()  # for the test's reference
        return out


@pytest.mark.parametrize("mode", ["causal", "bool", "additive"])
def test_sdpa_fallback_on_a_plain_module(mode):
    torch.manual_seed(0)
    model = SDPAModule(mode)
    n = 20
    model.keep = torch.rand(2, 1, n, n) > 0.4
    model.bias = torch.randn(1, 4, n, n)
    x = torch.randn(2, n, 16)
    expected = model(x)
    with monitor(model, block=6) as mon:
        out = model(x)
    assert torch.equal(out, expected)
    z = _logits(model.q, model.k, 0.5, None, model.bias if mode == "additive" else None)
    keep = (torch.ones(n, n, dtype=torch.bool).tril() if mode == "causal" else model.keep)
    assert_records_match(mon.records, reference(z, keep))
    assert {r["module"] for r in mon.records} == {"SDPAModule"}


def test_sdpa_calls_outside_the_model_are_not_observed():
    model = SDPAModule("causal")
    q = torch.randn(1, 2, 5, 8)
    with monitor(model) as mon:
        F.scaled_dot_product_attention(q, q, q)
    assert mon.records == []


def test_second_call_in_one_module_gets_its_own_site():
    class Twice(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(F.scaled_dot_product_attention(q, q, q), q, q)

    model = Twice()
    with monitor(model) as mon:
        model(torch.randn(1, 1, 4, 8))
    assert [r["module"] for r in mon.records] == ["Twice", "Twice#1"]


# ---------------------------------------------------------------------------------------------
# Attach and detach

def test_everything_is_removed_when_the_body_raises():
    model = nn.Sequential(MultiHeadAttention(16, 2, "softcap"), nn.Linear(16, 16))
    before = hook_count(model)
    with pytest.raises(RuntimeError, match="boom"):
        with monitor(model):
            assert hook_count(model) > before
            assert F.scaled_dot_product_attention is not ORIGINAL_SDPA
            model(torch.randn(1, 4, 16))
            raise RuntimeError("boom")
    assert hook_count(model) == before
    assert_clean()


def test_everything_is_removed_when_the_forward_raises():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = MultiHeadAttention(16, 2)

        def forward(self, x):
            self.attn(x)
            raise ValueError("inside forward")

    model = Fails()
    with pytest.raises(ValueError, match="inside forward"):
        with monitor(model) as mon:
            model(torch.randn(1, 4, 16))
    assert hook_count(model) == 0
    assert mon._watch._stack == []
    assert_clean()
    with monitor(model.attn) as again:  # a fresh monitor works afterwards
        model.attn(torch.randn(1, 4, 16))
    assert len(again.records) == 2


def test_nested_monitors_both_observe_and_restore():
    inner_model = MultiHeadAttention(16, 2)
    outer_model = nn.Sequential(inner_model)
    with monitor(outer_model) as outer:
        with monitor(inner_model) as inner:
            outer_model(torch.randn(1, 3, 16))
        assert F.scaled_dot_product_attention is not ORIGINAL_SDPA  # outer still active
    assert_clean()
    assert len(outer.records) == len(inner.records) == 2
    assert outer.records[0]["module"] == "0"
    assert inner.records[0]["module"] == "MultiHeadAttention"


def test_a_monitor_cannot_be_entered_twice():
    mon = Monitor(MultiHeadAttention(16, 2))
    with mon:
        with pytest.raises(RuntimeError, match="already active"):
            mon.__enter__()
    assert_clean()


# ---------------------------------------------------------------------------------------------
# Results: DataFrame, TensorBoard

def test_to_frame_has_the_record_columns():
    mha = MultiHeadAttention(16, 2)
    with monitor(mha) as mon:
        mha(torch.randn(1, 5, 16))
    frame = mon.to_frame()
    assert list(frame.columns) == list(RECORD_KEYS)
    assert len(frame) == 2


def test_to_frame_without_pandas_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` now raises ImportError
    with pytest.raises(ImportError, match="pip install pandas"):
        Monitor(nn.Linear(1, 1)).to_frame()


class FakeWriter:
    def __init__(self):
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def test_writer_gets_per_layer_and_head_scalars_every_nth_step():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2)
    writer = FakeWriter()
    with monitor(mha, writer=writer, step=10, every=2) as mon:
        for _ in range(4):
            mha(torch.randn(1, 5, 16))
    assert mon.step == 14
    assert sorted({step for _, _, step in writer.scalars}) == [10, 12]
    tags = {tag for tag, _, step in writer.scalars if step == 10}
    assert "attnscale/entropy_mean/layer0/head1" in tags
    assert "attnscale/logit_absmax/layer0" in tags
    assert len(tags) == len(SCALAR_KEYS) * (2 + 1)  # every statistic, two heads plus the layer
    assert mon.records[0]["queries"] == 2 * 5  # two of the four forward passes were observed


def test_tensorboard_summary_writer(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    mha = MultiHeadAttention(16, 2)
    with SummaryWriter(tmp_path) as writer, monitor(mha, writer=writer):
        mha(torch.randn(1, 5, 16))
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_package_level_attention_calls_are_observed_once():
    class Functional(nn.Module):
        def forward(self, q):
            return attnscale.attention(q, q, q, "softcap", causal=True)  # blockwise kernel

    model, q = Functional(), torch.randn(1, 2, 9, 8)
    with monitor(model) as mon:
        model(q)
    assert [r["queries"] for r in mon.records] == [9, 9]
    assert_clean()


# ---------------------------------------------------------------------------------------------
# The observer hook: nothing attnscale defines is replaced, nothing is recomputed

def test_attention_is_the_same_object_while_a_monitor_is_active():
    mha = MultiHeadAttention(16, 2)
    with monitor(mha) as mon:
        assert attention_module.attention is ORIGINAL_ATTENTION
        assert attnscale.attention is ORIGINAL_ATTENTION
        (observer,) = attention_module.observers()  # its watch's (see observer.eager)
        assert getattr(observer, "__wrapped__", observer) == mon._watch._observe_pipeline
        mha(torch.randn(1, 5, 16))
    assert attention_module.observers() == ()
    assert len(mon.records) == 2
    assert_clean()


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_the_monitor_does_not_run_the_mechanism_again(name):
    mha = MultiHeadAttention(16, 2, name).eval()
    calls = []
    prepare = mha.mechanism.prepare

    def counted(*args):
        calls.append(1)
        return prepare(*args)

    mha.mechanism.prepare = counted
    x = torch.randn(1, 6, 16)
    mha(x, causal=True)
    plain = len(calls)
    with monitor(mha) as mon:
        mha(x, causal=True)
    assert plain == 1 and len(calls) == 2 and len(mon.records) == 2


@pytest.mark.parametrize("param,value", [("block", True), ("block", 0), ("step", -1),
                                         ("step", False), ("every", 0), ("every", True)])
def test_monitor_refuses_bad_arguments_naming_them(param, value):
    with pytest.raises(ConfigError, match=f"^{param} must"):
        monitor(MultiHeadAttention(16, 2), **{param: value})


def test_block_is_validated_once_where_it_enters(monkeypatch):
    import attnscale.measure.monitor.blocks as blocks

    checked = []
    real = blocks.check_int
    monkeypatch.setattr(blocks, "check_int", lambda *a, **k: checked.append(a) or real(*a, **k))
    mha = MultiHeadAttention(16, 2)
    with monitor(mha, block=3):
        for _ in range(3):
            mha(torch.randn(1, 5, 16))
    assert checked == []  # the monitor checked block once, at construction
    head_stats(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), block=2)
    assert len(checked) == 1


def test_a_forward_pass_with_nothing_observed_warns_once():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(RuntimeWarning, match="observed no attention call in a forward pass") as got:
        with monitor(model) as mon:
            model(torch.randn(2, 4))
            model(torch.randn(2, 4))
    assert len([w for w in got if "no attention call" in str(w.message)]) == 1
    assert mon.records == []


# ---------------------------------------------------------------------------------------------
# The entropy heatmap: one fixed colour scale

def _records(entropies):
    return [{"layer": i // 2, "head": i % 2, "entropy_mean": e, "max_weight_mean": 0.5}
            for i, e in enumerate(entropies)]


@pytest.mark.parametrize("entropies", [[1.91668, 1.91670, 1.91675, 1.91680], [0.1, 3.0, 2.0, 0.0]])
def test_entropy_heatmap_uses_the_fixed_scale_zero_to_ln_n(entropies):
    import matplotlib  # a dependency of attnscale: never skipped
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        plot_entropy(_records(entropies), ax, n_keys=64)
        image = ax.images[0]
        assert_close(torch.tensor(image.get_clim()), torch.tensor([0.0, math.log(64)]))
        label = fig.axes[-1].get_ylabel()
        assert "ln 64" in label and "nats" in label
        ax.clear()
        plot_entropy(_records(entropies), ax, stat="max_weight_mean", n_keys=64)
        assert_close(torch.tensor(ax.images[0].get_clim()), torch.tensor([0.0, 1.0]))
    finally:
        plt.close(fig)
    with pytest.raises(ConfigError, match="n_keys"):
        colour_limits("entropy_mean")


# ---------------------------------------------------------------------------------------------
# Soft-cap: the statistics come from the kernel that forms the logits (Observation.request_rows)

class _Rule:
    """A capped rule with a per-row tensor scale (no registry mechanism has both)."""

    def __init__(self, cap: float, scale):
        self.cap, self.scale = cap, scale

    def prepare(self, q, k, n_keys):
        return q, k, self.scale


class _Attend(nn.Module):
    """A module whose forward is one pipeline call, so a monitor can attribute it."""

    def __init__(self, rule, mask, causal, trace=False):
        super().__init__()
        self.rule, self.mask, self.causal, self.trace = rule, mask, causal, trace

    def forward(self, q, k, v):
        out = pipeline.run(q, k, v, self.rule, mask=self.mask, causal=self.causal,
                           trace=self.trace)
        return out.out if self.trace else out


def _capped_case(name: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    b, h, n_q, n_k, d = 2, 3, 70, 70, 8
    q, k, v = (3 * torch.randn(b, h, n, d, generator=gen) for n in (n_q, n_k, n_k))
    mask, causal, scale = None, False, 0.4
    if name == "causal":
        causal = True
    elif name == "mask-empty-rows-row-scale":
        mask = torch.rand(b, 1, n_q, n_k, generator=gen) > 0.5
        mask[0, 0, 4] = False                     # a query with no key: not a row
        mask[1, 0, 9:12] = False
        scale = torch.rand(b, h, n_q, 1, generator=gen)
        causal = True
    return (q.to(dtype), k.to(dtype), v.to(dtype)), _Rule(2.5, scale), mask, causal


CAPPED_CASES = ["plain", "causal", "mask-empty-rows-row-scale"]


def _capped_records(module, qkv, monkeypatch, *, from_kernel: bool, block: int = 16):
    with monkeypatch.context() as patch:
        if not from_kernel:  # the monitor's own blockwise recomputation, as before
            patch.setattr(pipeline.Observation, "request_rows", lambda self, sink: False)
        with monitor(module, block=block) as mon:
            out = module(*qkv)
    return mon.records, out


@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", CAPPED_CASES)
def test_softcap_records_from_the_kernel_equal_the_recomputed_ones(name, dtype, small_blocks,
                                                                   backend, monkeypatch):
    qkv, rule, mask, causal = _capped_case(name, dtype)
    if small_blocks:  # several kernel blocks of 24 queries, statistics in chunks of 10
        monkeypatch.setattr(softcap, "CAPPED_BLOCK_ELEMENTS", 24 * qkv[1].shape[-2])
        monkeypatch.setattr(softcap, "STATS_ROWS", 10)
    for trace in (False, True):   # the blockwise kernel, and the materialised path
        module = _Attend(rule, mask, causal, trace)
        got, out = _capped_records(module, qkv, monkeypatch, from_kernel=True)
        want, out_recomputed = _capped_records(module, qkv, monkeypatch, from_kernel=False)
        assert torch.equal(out, out_recomputed) and torch.equal(out, module(*qkv))
        assert [r["queries"] for r in got] == [r["queries"] for r in want]
        for key in RECORD_KEYS[4:]:
            assert_close(torch.tensor([r[key] for r in got]),
                         torch.tensor([r[key] for r in want]), rtol=2e-5, atol=2e-6, msg=key)


def test_softcap_monitor_does_not_score_the_logits_again(monkeypatch):
    import attnscale.measure.monitor.observer as observer

    def recompute(*args, **kwargs):
        raise AssertionError("the monitor recomputed logits the kernel had formed")

    monkeypatch.setattr(observer, "call_head_stats", recompute)
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, "softcap", cap=2.0)
    x = torch.randn(2, 24, 32)
    with monitor(mha) as mon:
        mha(x, causal=True)
    assert len(mon.records) == 4 and all(r["queries"] == 48 for r in mon.records)
    traced = _Attend(mha.mechanism, None, True, trace=True)   # the materialised path
    with torch.no_grad(), monitor(traced) as mon:
        traced(*_mha_qkv(mha, x))
    assert len(mon.records) == 4 and all(r["queries"] == 48 for r in mon.records)
    with pytest.raises(AssertionError, match="recomputed"):  # SDPA forms no logits
        with monitor(MultiHeadAttention(32, 4, "scaled")) as mon:
            mon.model(x)


def test_request_rows_only_where_the_computation_forms_the_logits():
    offered = []

    def observer(seen: pipeline.Observation) -> None:
        offered.append((seen.offers_rows, seen.request_rows(lambda rows: offered.append(rows))))

    q = k = v = torch.randn(1, 2, 5, 4)
    with pipeline.observe(observer):
        pipeline.run(q, k, v, _Rule(None, 0.5))               # SDPA
        pipeline.run(q, k, v, _Rule(3.0, 0.5))                # blockwise soft-cap kernel
    assert offered[0] == (False, False)
    assert offered[1] == (True, True)
    rows = offered[2]
    assert rows.shape == (1, 2, 5, len(stats.ROW_STATS_COLUMNS)) and rows.dtype == torch.float64
    assert_close(rows, stats.row_stats(pipeline.logits(q, k, 0.5, 3.0)), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The observer contract: Watch, Call, Totals (what the monitor and the guard are built on)


class _Pair(nn.Module):
    """Two attention layers on one input; the second called twice in one forward pass (each
    call a forward of its own, so one site: ``name#1`` is a module's second call inside its own
    forward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = MultiHeadAttention(16, 2), MultiHeadAttention(16, 2)

    def forward(self, x, mask=None):
        return self.first(x, causal=True) + self.second(x, mask=mask) + self.second(x)


def test_a_watch_hands_its_owner_the_calls_it_selects():
    model, x = _Pair(), torch.randn(2, 7, 16)
    calls, ended, totals = [], [], Totals()

    def observe(call: Call) -> None:
        calls.append(call)
        call.statistics(lambda s: totals.add(call.site, s), block=3)

    passes = iter([True, False, True, True])
    watch = Watch(model, observe, selects=lambda module, args, kwargs: next(passes),
                  counts=lambda module: module is not model.first,
                  ended=lambda module, n: ended.append((module, n)))
    with watch:
        assert watch.active and watch.names[model.second] == "second"
        for _ in range(3):
            model(x)
        model.first(x)  # a pass entering at a submodule whose calls do not count
    assert not watch.active and hook_count(model) == 0
    assert ended == [(model, 2), (model, None), (model, 2), (model.first, 0)]
    assert [(c.site, c.layer) for c in calls] == [("second", "second")] * 4
    assert all(c.observation is not None and c.q.shape == (2, 2, 7, 8) for c in calls)
    taken = totals.take()
    assert list(taken) == ["second"] and not totals
    assert taken["second"].queries.tolist() == [2 * 2 * 2 * 7] * 2  # passes x calls x B x Nq


def test_a_watch_ended_by_a_pass_that_raised_in_selects():
    model = MultiHeadAttention(16, 2)

    def selects(module, args, kwargs):
        raise ValueError("refused")

    ended = []
    with Watch(model, lambda call: None, selects=selects,
               ended=lambda module, n: ended.append(n)):
        with pytest.raises(ValueError, match="refused"):
            model(torch.randn(1, 3, 16))
    assert ended == [None] and hook_count(model) == 0


@pytest.mark.parametrize("masking", ["none", "causal", "mask", "mask+causal"])
def test_a_call_counts_the_keys_as_the_pipeline_did(masking):
    """A pipeline call's most_keys is the pipeline's own key count (not recomputed from the
    mask); an SDPA-tapped call's, from SDPA's mask and causality, is the same number."""
    q, k = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 9, 8)
    mask = torch.rand(2, 1, 6, 9, generator=torch.Generator().manual_seed(0)) > 0.6
    mask[1, 0, 2, :] = True
    mask = mask if "mask" in masking else None
    causal = "causal" in masking
    seen = []
    with pipeline.observe(seen.append):
        pipeline.run(q, k, k, build_mechanism("scaled", 8, 2), mask=mask, causal=causal)
    (obs,) = seen
    want = int(key_mask(mask, causal, q, k).sum(-1).max()) if mask is not None or causal else 9
    piped = Call("a", "a", obs.q, obs.k, obs.scale, None, mask, causal, obs)
    tapped = Call("a", "a", q, k, None, None, mask, causal)
    bias = None if mask is None else torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    additive = Call("a", "a", q, k, None, None, bias, causal)
    assert piped.most_keys() == tapped.most_keys() == additive.most_keys() == want
    # read from the observation: a count the pipeline gave wins over q, k and the mask
    counted = Call("a", "a", q, k, None, None, None, False,
                   pipeline.Observation(q, k, 1.0, None, None, False, torch.tensor([[3], [5]]),
                                        None))
    assert counted.most_keys() == 5


def test_a_calls_peak_logits_are_its_statistics_logit_max_when_uncapped():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    for cap in (None, 2.0):
        call = Call("a", "a", q, k, 0.5, cap, None, True)
        got = []
        call.statistics(got.append, block=2)
        z = (q.double() @ k.double().transpose(-1, -2)) * 0.5
        z = z.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
        assert_close(call.peak_logits(), z.amax((0, 2, 3)))  # before the cap
        assert call.peaks_in_statistics == (cap is None)
        if cap is None:
            assert_close(got[0].logit_max, call.peak_logits())
        else:
            assert bool((got[0].logit_max < call.peak_logits()).all())
