"""The API against the hardening classes, each over every mechanism of the registry (or every
command it applies to), so a new mechanism or command is covered without editing this file:

* every statistic covers only the keys a query attends: the monitor (its own blocks and the
  soft-cap kernel's rows), the materialised trace, the row kernel's key limit, the tracked maxima
  of a mechanism and the LM's logit records, each against a float64 reference that masks by hand,
  with the masked keys' logits made huge so that a leak shows;
* empty inputs (no query, no key) give zeros, with a mask, causality or neither;
* misfitting inputs (integer or mixed dtypes, a mechanism built for other heads or d, a module in
  another dtype) are one-line ConfigErrors that say what to change;
* devices are told apart by kind and checked up front;
* option values are read by the option's declared type, in every command that takes --option;
* a Hugging Face model with a swapped mechanism never runs another attention implementation.
"""

from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attnscale
import attnscale.cli as cli_module
from attnscale.attention import MultiHeadAttention, observe
from attnscale.errors import ConfigError, parse_typed
from attnscale.measure.monitor import monitor
from attnscale.mechanisms import (MECHANISMS, build_mechanism, check_mechanism, mechanism_options,
                                  option_types, parse_option)
from attnscale.stats import row_stats
from attnscale.workers import check_device
from normalisers import reference_distribution_stats, reference_weights, sink_of

NAMES = list(MECHANISMS)
B, H, D = 2, 2, 8                     # batch, heads, d_head of the bare-attention cases
LEAK = 1e3                            # masked keys are scaled by this: a leak cannot hide


def _one_line(err: BaseException | str) -> str:
    text = str(err).strip()
    assert text and "\n" not in text, text
    return text


# --- a float64 reference that masks by hand -------------------------------------------------------

def reference_rows(z: torch.Tensor, keep: torch.Tensor, mech=None) -> dict[str, torch.Tensor]:
    """Per-row statistics of the mechanism's normaliser (softmax when None) over the attended
    keys of float64 logits z (..., Nq, Nk): written out from the definitions (no stable tricks
    needed in float64 at these sizes; tests/normalisers.py for the sink and sigmoid)."""
    z = z.double()
    keep = keep.expand_as(z)
    count = keep.sum(-1)
    zv = torch.where(keep, z, 0.0)
    mean = zv.sum(-1, keepdim=True) / count.clamp(min=1).unsqueeze(-1)
    var = (torch.where(keep, z - mean, 0.0) ** 2).sum(-1) / (count - 1).clamp(min=1)
    weights = reference_distribution_stats(z, keep, "softmax" if mech is None else mech.normaliser,
                                           None if mech is None else sink_of(mech))
    return {"count": count, "max_weight": weights["max_weight"], "entropy": weights["entropy"],
            "jacobian_fro": weights["jacobian_fro"],
            "logit_std": torch.where(count >= 2, var.sqrt(), 0.0),
            "logit_absmax": torch.where(keep, z.abs(), 0.0).amax(-1)}


def reference_heads(z: torch.Tensor, keep: torch.Tensor, mech=None) -> dict[str, list[float]]:
    """The monitor's record statistics per head from :func:`reference_rows`, (B, H, Nq, Nk)."""
    rows = reference_rows(z, keep, mech)
    ok = rows["count"] > 0                                                   # (B, H, Nq)
    n = ok.sum((0, 2)).double()

    def mean(x):
        return (torch.where(ok, x, 0.0).sum((0, 2)) / n).tolist()

    return {"queries": n.tolist(), "entropy_mean": mean(rows["entropy"]),
            "entropy_min": torch.where(ok, rows["entropy"], math.inf).amin((0, 2)).tolist(),
            "max_weight_mean": mean(rows["max_weight"]), "logit_std": mean(rows["logit_std"]),
            "logit_absmax": torch.where(ok, rows["logit_absmax"], 0.0).amax((0, 2)).tolist(),
            "jacobian_fro_mean": mean(rows["jacobian_fro"])}


def padded_mask(n_q: int, n_k: int) -> torch.Tensor:
    """(B, 1, Nq, Nk): batch 0 attends every key; batch 1 hides its last two keys (right
    padding) and key 1 (a hole no key count can describe), and its query 2 sees no key."""
    keep = torch.ones(B, 1, n_q, n_k, dtype=torch.bool)
    keep[1, :, :, -2:] = False
    keep[1, :, :, 1] = False
    keep[1, :, 2, :] = False
    return keep


class _Wrap(torch.nn.Module):
    """A bare mechanism called on given q, k, v with a mask: the model the monitor watches."""

    def __init__(self, mech):
        super().__init__()
        self.mech = mech

    def forward(self, q, k, v, mask=None, causal=False):
        return attnscale.attention(q, k, v, self.mech, mask=mask, causal=causal)


def _inputs(n_q: int, n_k: int, keep: torch.Tensor, dtype=torch.float64, seed: int = 0):
    """q, k, v with the masked keys of batch 1 scaled by LEAK (huge logits if they leak)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n_q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, n_k, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, n_k, D, generator=g, dtype=torch.float64)
    hidden = ~keep[1, 0].any(0)                                              # (Nk,)
    k[1, :, hidden] *= LEAK
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _logits_and_keep(mech, q, k, keep, causal):
    """The mechanism's float64 logits (its own formula, eval mode) and the attended keys."""
    full = keep.expand(B, H, *keep.shape[-2:])
    if causal:
        full = full & torch.ones(full.shape[-2:], dtype=torch.bool).tril()
    was = mech.training
    mech.eval()
    with torch.no_grad():
        z = mech.double().logits(q.double(), k.double(), full.sum(-1, keepdim=True), mask=full)
    mech.train(was)
    return z, full


# --- 1. every statistic covers only the keys a query attends ----------------------------------

# The mechanisms whose weights are a softmax of per-key logits, which the float64 formula above
# describes: every one unless its class declares another normaliser or a per-row temperature.
# Every mechanism, whatever its normaliser, is also held to test_hidden_keys_change_nothing.
SOFTMAX = [name for name in NAMES
           if getattr(MECHANISMS[name], "normaliser", "softmax") == "softmax"
           and getattr(MECHANISMS[name], "per_key", True)]


def _built(name: str):
    """The mechanism at its init, the same on every call (a random init is seeded locally)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build_mechanism(name, D, H).double()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", NAMES)
def test_hidden_keys_change_nothing(name, causal):
    """Replacing every hidden key and value by other, huge ones changes no output, no weight,
    no offered row statistic and no monitor record: every mechanism, every normaliser."""
    n = 7
    keep = padded_mask(n, n)
    q, k, v = _inputs(n, n, keep)
    hidden = ~keep[1, 0].any(0)                                              # (Nk,)
    g = torch.Generator().manual_seed(9)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, hidden] = torch.randn(H, int(hidden.sum()), D, generator=g, dtype=torch.float64) * 3e3
    v2[1, :, hidden] = torch.randn(H, int(hidden.sum()), D, generator=g, dtype=torch.float64) * 3e3
    seen = []
    for keys, values in ((k, v), (k2, v2)):
        model = _Wrap(_built(name))
        rows = []
        with monitor(model) as mon:
            out = model(q, keys, values, mask=keep, causal=causal)
        with observe(lambda obs: obs.request_rows(rows.append)):
            trace = attnscale.attention(q, keys, values, model.mech, mask=keep, causal=causal,
                                        trace=True)
        seen.append((out, trace.weights, trace.out, rows, mon.records))
    (out, weights, traced, rows, records), (out2, weights2, traced2, rows2, records2) = seen
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(weights2, weights)
    torch.testing.assert_close(traced2, traced)
    full = keep.expand(B, H, n, n) & (torch.ones(n, n, dtype=torch.bool).tril() if causal else True)
    assert (weights[~full] == 0).all()
    torch.testing.assert_close(rows2, rows)
    assert len(records) == len(records2) == H
    for r, r2 in zip(records, records2):
        torch.testing.assert_close(torch.tensor(list(r2.values())[3:], dtype=torch.float64),
                                   torch.tensor(list(r.values())[3:], dtype=torch.float64),
                                   equal_nan=True)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", SOFTMAX)
def test_monitor_counts_only_attended_keys(name, causal, dtype):
    """The monitor's records equal a float64 reference over the attended keys: float32 runs the
    compiled row kernel (and softcap's own kernel rows), float64 the PyTorch formulation."""
    n = 7
    keep = padded_mask(n, n)
    q, k, v = _inputs(n, n, keep, dtype)
    mech = build_mechanism(name, D, H).to(dtype)
    model = _Wrap(mech)
    with monitor(model) as mon:
        model(q, k, v, mask=keep, causal=causal)
    z, full = _logits_and_keep(build_mechanism(name, D, H), q, k, keep, causal)
    want = reference_heads(z, full, mech)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-9}
    for key, expected in want.items():
        got = [r[key] for r in mon.records]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64), **tol,
                                   msg=lambda m, key=key: f"{name} {key}: {m}")


@pytest.mark.parametrize("name", SOFTMAX)
def test_trace_and_offered_rows_count_only_attended_keys(name):
    """trace=True: weights are the masked softmax (0 on hidden keys and on rows without keys),
    and the row statistics it offers observers equal the reference."""
    n = 6
    keep = padded_mask(n, n)
    q, k, v = _inputs(n, n, keep)
    mech = build_mechanism(name, D, H).double()
    got_rows = []
    with observe(lambda seen: seen.request_rows(got_rows.append)):
        trace = attnscale.attention(q, k, v, mech, mask=keep, trace=True)
    z, full = _logits_and_keep(build_mechanism(name, D, H), q, k, keep, False)
    want = reference_rows(z, full, mech)
    p = reference_weights(z, full, mech.normaliser, sink_of(mech))
    torch.testing.assert_close(trace.weights, p)
    assert (trace.weights[~full] == 0).all()
    torch.testing.assert_close(trace.out, p @ v)
    (rows,) = got_rows
    for i, key in enumerate(("count", "max_weight", "entropy", "jacobian_fro", "logit_std",
                             "logit_absmax")):
        torch.testing.assert_close(rows[..., i], want[key].double(), msg=lambda m: f"{key}: {m}")


def _tracks_a_maximum(name: str) -> bool:
    """Mechanisms that keep a running per-head logit maximum (qk-clip's S_max)."""
    return "s_max" in dict(build_mechanism(name, D, H).named_buffers())


TRACKERS = [name for name in NAMES if _tracks_a_maximum(name)]


@pytest.mark.parametrize("name", TRACKERS)
def test_tracked_maximum_counts_only_attended_keys(name):
    """A tracked per-head maximum logit, after one training-mode call under a mask with holes
    and padding, is the maximum over the attended keys only."""
    n = 6
    keep = padded_mask(n, n)
    q, k, v = _inputs(n, n, keep)
    mech = build_mechanism(name, D, H).double().train()
    attnscale.attention(q, k, v, mech, mask=keep)
    z, full = _logits_and_keep(build_mechanism(name, D, H), q, k, keep, False)
    want = z.masked_fill(~full, -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(mech.s_max, want)


def test_tracked_maximum_is_found_in_the_registry():
    """The class-wide test above has something to test (qk-clip tracks S_max)."""
    assert "qk-clip" in TRACKERS


def _guarded(name: str, q, k, v, keep, causal):
    """The guard's records of one training forward of a bare mechanism, step 0."""
    model = _Wrap(build_mechanism(name, D, H).to(q.dtype)).train()
    with attnscale.guard(model, every=1) as g:
        model(q, k, v, mask=keep, causal=causal)
        g.step(0)
    return g.records


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", SOFTMAX)
def test_guard_records_count_only_attended_keys(name, causal):
    """The guard's per-head records (largest signed and absolute logit, entropies, max weight,
    logit std) equal the float64 reference over the attended keys."""
    n = 7
    keep = padded_mask(n, n)
    q, k, v = _inputs(n, n, keep)
    records = _guarded(name, q, k, v, keep, causal)
    z, full = _logits_and_keep(build_mechanism(name, D, H), q, k, keep, causal)
    want = reference_heads(z, full)
    want["logit_max"] = z.masked_fill(~full, -math.inf).amax(dim=(0, 2, 3)).tolist()
    for key, expected in want.items():
        if key == "jacobian_fro_mean":  # not a guard record
            continue
        torch.testing.assert_close(torch.tensor([r[key] for r in records], dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64),
                                   msg=lambda m, key=key: f"{name} {key}: {m}")


def test_guard_n_keys_is_the_most_keys_a_query_attends():
    """n_keys (the n of the entropy's range [0, ln n]) when a mask hides the same keys from
    every query, as a static KV cache's unused slots are: 5 of 7 keys, not 7."""
    n = 7
    keep = torch.ones(B, 1, n, n, dtype=torch.bool)
    keep[..., -2:] = False
    q, k, v = _inputs(n, n, keep)
    records = _guarded("scaled", q, k, v, keep, False)
    assert [r["n_keys"] for r in records] == [n - 2] * H


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
def test_monitor_of_a_foreign_sdpa_call_counts_only_attended_keys(additive):
    """The monitor's SDPA tap (foreign models): a boolean mask, or an additive one whose hidden
    entries are at or below MASKED_BIAS and whose others are biases of the logits."""
    n = 6
    keep = padded_mask(n, n)
    q, k, v = _inputs(n, n, keep)
    bias = torch.linspace(-0.5, 0.5, n, dtype=torch.float64)
    mask = torch.where(keep, bias, torch.finfo(torch.float64).min) if additive else keep

    class Foreign(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    model = Foreign()
    with monitor(model) as mon:
        model(q, k, v)
    z = q @ k.transpose(-2, -1) / math.sqrt(D) + (bias if additive else 0.0)
    want = reference_heads(z, keep.expand(B, H, n, n))
    for key, expected in want.items():
        torch.testing.assert_close(torch.tensor([r[key] for r in mon.records], dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64),
                                   msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("portable", [False, True, 2], ids=["native", "portable", "avx2"])
def test_row_kernel_limit_hides_huge_logits(portable):
    """The row kernel's key limit (causality as counts) and -inf masks: hidden logits of 1e30
    change nothing.  The compiled kernel, both instruction sets, against the reference."""
    from attnscale.kernels import native, rowstats
    if not native.available():
        pytest.skip("the compiled kernels are not built")  # the PyTorch path is tested below
    g = torch.Generator().manual_seed(3)
    z = torch.randn(3, 5, 40, generator=g)
    limit = torch.tensor([0, 1, 7, 39, 40], dtype=torch.int64)
    keep = torch.arange(40) < limit.unsqueeze(-1)                            # (5, 40)
    z = torch.where(keep, z, 1e30)                                            # beyond the limit
    z[0, :, 3] = -math.inf                                                    # and a hole
    keep = keep & ~torch.isneginf(z)
    got = rowstats.row_stats(z, limit=limit, portable=portable)
    want = reference_rows(torch.where(keep, z, 0.0), keep)
    for i, key in enumerate(("count", "max_weight", "entropy", "jacobian_fro", "logit_std",
                             "logit_absmax")):
        torch.testing.assert_close(got[..., i], want[key].double(), rtol=1e-5, atol=1e-5)


def test_statistics_module_hides_masked_keys_without_the_kernel():
    """attnscale.stats.row_stats in float64 (the PyTorch formulation): -inf keys change nothing
    however large the others' logits are."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(4, 3, 9, generator=g, dtype=torch.float64)
    keep = torch.rand(4, 3, 9, generator=g) > 0.4
    keep[0, 0] = False
    got = row_stats(z.masked_fill(~keep, -math.inf))
    want = reference_rows(z, keep)
    for i, key in enumerate(("count", "max_weight", "entropy", "jacobian_fro", "logit_std",
                             "logit_absmax")):
        torch.testing.assert_close(got[..., i], want[key].double())


@pytest.fixture
def text_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ATTNSCALE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "text"
    shutil.copytree(Path(attnscale.__file__).parent / "mechanisms", out,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return out


@pytest.mark.parametrize("name", SOFTMAX)
def test_lm_logit_records_count_only_the_causal_keys(text_dir, name):
    """The LM's step-0 records (max |logit|, min and mean over heads of the mean entropy) in
    layer 0 equal the reference over each query's causal prefix, from the same init and batch."""
    from lm_reference import first_layer_qk

    from attnscale.experiments.lm.train import LMRunConfig, train_lm
    config = LMRunConfig(d_model=16, n_layers=1, n_heads=2, seq_len=12, batch_size=2, steps=1,
                       eval_windows=2, monitor_every=1, data=str(text_dir), mechanism=name)
    record = train_lm(config)
    block, q, k = first_layer_qk(config, text_dir)
    b, _, n, _ = q.shape
    with torch.no_grad():
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        z = block.attn.mechanism.logits(q, k, causal.sum(-1, keepdim=True), mask=causal,
                                        log_forget=block.attn.log_forget)
    want = reference_heads(z, causal.expand(b, 2, n, n), block.attn.mechanism)
    row = record["trace"][0]
    assert row["attn_logit_max"][0] == pytest.approx(max(want["logit_absmax"]), rel=1e-5)
    assert row["entropy_min"][0] == pytest.approx(min(want["entropy_mean"]), rel=1e-5)
    assert row["entropy_mean"][0] == pytest.approx(sum(want["entropy_mean"]) / 2, rel=1e-5)


# --- 2. empty inputs give zeros ---------------------------------------------------------------

EMPTY = [(0, 5), (4, 0), (0, 0)]


@pytest.mark.parametrize("name", NAMES)
def test_empty_queries_or_keys_give_zeros(name):
    """No query or no key: zeros of the right shape (an empty softmax row weighs nothing) and
    finite gradients, with no mask, a mask, causality or both, fused or traced."""
    mech = build_mechanism(name, D, H)
    for n_q, n_k in EMPTY:
        for how in ({}, {"causal": True}, {"mask": torch.ones(n_q, n_k, dtype=torch.bool)},
                    {"mask": torch.zeros(B, 1, n_q, n_k, dtype=torch.bool), "causal": True}):
            for trace in (False, True):
                q = torch.randn(B, H, n_q, D, requires_grad=True)
                k = torch.randn(B, H, n_k, D, requires_grad=True)
                v = torch.randn(B, H, n_k, 3, requires_grad=True)
                for chosen in (name, mech):  # a registry name and a built mechanism
                    got = attnscale.attention(q, k, v, chosen, trace=trace, **how)
                    out = got.out if trace else got
                    assert out.shape == (B, H, n_q, 3), (n_q, n_k, how)
                    torch.testing.assert_close(out, torch.zeros(B, H, n_q, 3))
                    out.sum().backward()
                    assert all(t.grad is None or bool(t.grad.isfinite().all()) for t in (q, k, v))


@pytest.mark.parametrize("name", NAMES)
def test_multi_head_attention_on_empty_sequences(name):
    """MultiHeadAttention with N = 0, and cross-attention to an empty context: zeros (through
    W_O, whose bias is off), the right shapes."""
    mha = MultiHeadAttention(16, 2, name)
    torch.testing.assert_close(mha(torch.randn(2, 0, 16), causal=True), torch.zeros(2, 0, 16))
    if MECHANISMS[name].logit_bias == "forget":  # FoX: causal self-attention only
        with pytest.raises(ConfigError, match="causal=True and no context"):
            mha(torch.randn(2, 3, 16), context=torch.randn(2, 0, 16), causal=True)
        return
    torch.testing.assert_close(mha(torch.randn(2, 0, 16)), torch.zeros(2, 0, 16))
    out = mha(torch.randn(2, 3, 16), context=torch.randn(2, 0, 16))
    torch.testing.assert_close(out, torch.zeros(2, 3, 16))


# --- 3. misfitting inputs are one-line ConfigErrors -----------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_a_mechanism_built_for_other_heads_or_d_is_refused(name):
    """A mechanism built for another head count or head size: refused, naming both, by every
    way of calling it (attention, the mechanism as a module, its logits)."""
    q = torch.randn(1, H, 3, D)
    for heads, d in ((H + 1, D), (H, D // 2)):
        mech = build_mechanism(name, d, heads)
        for call in (lambda: attnscale.attention(q, q, q, mech), lambda: mech(q, q, q),
                     lambda: mech.logits(q, q)):
            with pytest.raises(ConfigError, match=f"n_heads={heads}, d_head={d}") as err:
                call()
            _one_line(err.value)


@pytest.mark.parametrize("name", NAMES)
def test_integer_and_mixed_dtypes_are_refused(name):
    """Integer q, k or v, or q, k, v of different dtypes: a ConfigError naming the dtype, for a
    registry name and a built mechanism."""
    x = torch.randn(1, H, 3, D)
    ints = torch.randint(0, 3, (1, H, 3, D))
    for chosen in (name, build_mechanism(name, D, H)):
        for args, text in (((ints, x, x), "q must be a floating-point tensor, got torch.int64"),
                           ((x, ints, x), "k must be a floating-point"),
                           ((x, x, ints.int()), "v must be a floating-point tensor, got torch.int32"),
                           ((x, x.double(), x), "one dtype")):
            with pytest.raises(ConfigError, match=text) as err:
                attnscale.attention(*args, chosen)
            _one_line(err.value)


@pytest.mark.parametrize("name", NAMES)
def test_inputs_on_several_devices_are_refused(name):
    """q, k, v (or the mask) on different devices: a ConfigError naming both devices, before
    any kernel runs (meta stands in for a second device on a CPU-only machine)."""
    x = torch.randn(1, H, 3, D)
    for chosen in (name, build_mechanism(name, D, H)):
        with pytest.raises(ConfigError, match="one device, got cpu, meta and cpu") as err:
            attnscale.attention(x, x.to("meta"), x, chosen)
        _one_line(err.value)
        with pytest.raises(ConfigError, match="mask is on meta but q is on cpu"):
            attnscale.attention(x, x, x, chosen,
                                mask=torch.ones(3, 3, dtype=torch.bool, device="meta"))
        with pytest.raises(ConfigError, match="mask must be a boolean tensor .* got list"):
            attnscale.attention(x, x, x, chosen, mask=[[True] * 3] * 3)


@pytest.mark.parametrize("name", NAMES)
def test_multi_head_attention_inputs_are_in_its_dtype(name):
    """MultiHeadAttention computes in its own dtype: fed another, it says what to cast; built in
    bf16 or float64 and fed that, it runs and returns that; under autocast a float32 module
    takes float32 and bf16 input."""
    mha = MultiHeadAttention(16, 2, name)
    causal_only = MECHANISMS[name].logit_bias == "forget"  # FoX: causal self-attention only
    for dtype in (torch.bfloat16, torch.float64, torch.float16):
        with pytest.raises(ConfigError, match=f"x is {dtype} but the module's weights are "
                                              "torch.float32") as err:
            mha(torch.randn(1, 3, 16, dtype=dtype))
        assert "x.to(torch.float32)" in _one_line(err.value)
    with pytest.raises(ConfigError, match="x must be floating point, got torch.int64"):
        mha(torch.randint(0, 3, (1, 3, 16)))
    with pytest.raises(ConfigError, match="context is torch.float64"):
        mha(torch.randn(1, 3, 16), context=torch.randn(1, 2, 16, dtype=torch.float64))
    with pytest.raises(ConfigError, match="d_model=16"):
        mha(torch.randn(1, 3, 8))
    keep = torch.tensor([[True, True, False], [True, False, True], [False, False, False]])
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        typed = MultiHeadAttention(16, 2, name, dtype=dtype)
        x = torch.randn(2, 3, 16, dtype=dtype)
        for how in ({}, {"causal": True}, {"mask": keep}, {"mask": keep, "causal": True}):
            if causal_only and not how.get("causal"):
                continue
            out = typed(x, **how)
            assert out.dtype == dtype and bool(out.isfinite().all()), (dtype, how)
        q = typed._split(typed.w_q(x))
        trace = attnscale.attention(q, q, q, typed.mechanism, mask=keep, trace=True)
        assert trace.out.dtype == dtype and bool(trace.out.isfinite().all()), dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for dtype in (torch.float32, torch.bfloat16):
            out = mha(torch.randn(1, 3, 16, dtype=dtype), causal=causal_only)
            assert bool(out.float().isfinite().all())


@pytest.mark.parametrize("mechanism", [None, 5, 1.5, MultiHeadAttention, ["scaled"]])
def test_a_mechanism_that_is_not_a_name_gets_a_plain_message(mechanism):
    """A non-string mechanism: no "Did you mean", a one-line message that says a name is a
    string; MultiHeadAttention and check_mechanism alike."""
    for call in (lambda: MultiHeadAttention(16, 2, mechanism),
                 lambda: check_mechanism(mechanism, param="--mechanism"),
                 lambda: build_mechanism(mechanism, D, H)):
        with pytest.raises(ConfigError) as err:
            call()
        text = _one_line(err.value)
        assert "Did you mean" not in text and type(mechanism).__name__ in text, text
    with pytest.raises(ConfigError, match="registry name or a built Mechanism, got int"):
        attnscale.attention(torch.randn(1, 1, 2, D), torch.randn(1, 1, 2, D),
                            torch.randn(1, 1, 2, D), 5)


@pytest.mark.parametrize("name", NAMES)
def test_multi_head_attention_keywords(name):
    """GQA keywords say GQA is not offered; another unknown keyword is blamed on
    MultiHeadAttention's keywords (and the mechanism's options), not on the mechanism alone."""
    for key in ("n_kv_heads", "num_key_value_heads"):
        with pytest.raises(ConfigError, match="grouped-query attention") as err:
            MultiHeadAttention(16, 2, name, **{key: 1})
        _one_line(err.value)
    with pytest.raises(ConfigError, match="MultiHeadAttention got an unknown keyword 'dropout'"):
        MultiHeadAttention(16, 2, name, dropout=0.1)
    import inspect
    params = inspect.signature(MECHANISMS[name].__init__).parameters
    mha_keywords = set(inspect.signature(MultiHeadAttention.__init__).parameters)
    own = {option: params[option].default for option in mechanism_options(name)
           if params[option].default is not inspect.Parameter.empty
           and option not in mha_keywords}  # a clash is refused, below
    assert type(MultiHeadAttention(16, 2, name, **own).mechanism) is MECHANISMS[name]
    with pytest.raises(ConfigError, match="bias must be True or False, got 0.5") as err:
        MultiHeadAttention(16, 2, name, bias=0.5)  # never read as "projection biases on"
    assert ("not" in _one_line(err.value)) == ("bias" in mechanism_options(name))


# --- 4. devices by kind, checked up front -----------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu", 0)])
def test_every_cpu_spelling_is_the_cpu(device):
    assert check_device("device", device).type == "cpu"


@pytest.mark.parametrize("device, match", [
    ("meta", "holds no data"), ("mps", "not available"), ("xla", "not available"),
    ("cuda:99", "CUDA device"), ("gpu", "not a torch device"), ("", "not a torch device"),
    (None, "not a torch device")])
def test_unusable_devices_are_one_line_errors(device, match):
    if device in ("mps", "xla", "cuda:99") and str(device).split(":")[0] in _usable_kinds():
        pytest.skip(f"{device} is usable on this machine")
    with pytest.raises(ConfigError, match=match) as err:
        check_device("--device", device)
    assert _one_line(err.value).startswith("--device: ")


def _usable_kinds() -> set[str]:
    kinds = {"cpu"}
    if torch.backends.mps.is_available():
        kinds.add("mps")
    if torch.cuda.is_available() and torch.cuda.device_count() > 99:
        kinds.add("cuda")
    return kinds


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) for every runnable command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for word, sub in subs[0].choices.items():
        yield from _leaves(sub, (*path, word))


def _commands_with(flag: str) -> list[tuple[str, ...]]:
    return [words for words, parser in _leaves(cli_module.build_parser())
            if any(flag in a.option_strings for a in parser._actions)]


def test_the_device_and_option_commands_are_found():
    """The class-wide CLI tests below have commands to walk."""
    assert ("lm",) in _commands_with("--device")
    assert {("lm",), ("train",)} <= set(_commands_with("--option"))


@pytest.mark.parametrize("words", _commands_with("--device"))
@pytest.mark.parametrize("device", ["meta", "xla", "cuda:99", "nope"])
def test_every_device_option_refuses_an_unusable_device(cli, words, device):
    if device.split(":")[0] in _usable_kinds():
        pytest.skip(f"{device} is usable on this machine")
    code, out, err = cli(*words, "--device", device, "--steps", "1")
    assert code == 2 and not out and "Traceback" not in err, err
    assert _one_line(err).startswith(f"attnscale {' '.join(words)}: error: ")


@pytest.mark.parametrize("device, match", [(torch.device("cpu"), "must be a string"),
                                           ("meta", "holds no data"), ("xla", "not available")])
def test_lm_api_checks_the_device_up_front(text_dir, device, match):
    """train_lm's config refuses an unusable device, or one its JSON record cannot hold, before
    reading any data."""
    from attnscale.experiments.lm.train import LMRunConfig
    if isinstance(device, str) and device in _usable_kinds():
        pytest.skip(f"{device} is usable on this machine")
    with pytest.raises(ConfigError, match=match) as err:
        LMRunConfig(data=str(text_dir / "missing"), device=device).validated()
    _one_line(err.value)


def test_lm_threads_bind_any_cpu_spelling(text_dir):
    """--threads sets the intra-op threads on the CPU however it is spelled (cpu, cpu:0)."""
    from attnscale.experiments.lm.train import LMRunConfig, train_lm
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for device in ("cpu", "cpu:0"):
            seen = []
            config = LMRunConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8, batch_size=2,
                               steps=1, eval_windows=2, data=str(text_dir), device=device,
                               threads=1)
            record = train_lm(config, after=lambda model, corpus: seen.append(
                torch.get_num_threads()))
            assert seen == [1] and record["config"]["threads"] == 1, (device, seen)
    finally:
        torch.set_num_threads(before)


# --- 5. option values by the option's declared type -----------------------------------------

def _texts(value) -> list[str]:
    """Ways a user writes ``value`` on a command line."""
    if isinstance(value, bool):
        return [str(value).lower(), str(value).upper(), str(value), "yes" if value else "no",
                str(int(value))]
    if isinstance(value, int):
        return [str(value), f"{float(value)}", f"{float(value):e}"]
    if isinstance(value, float):
        return [repr(value), f"{value:e}"]
    return [str(value)]


@pytest.mark.parametrize("name", NAMES)
def test_every_option_reads_by_its_declared_type(name):
    """Every option of every mechanism, written as text, reads back as its declared type and
    value; a text of the wrong kind is a one-line ConfigError naming the option."""
    import inspect
    params = inspect.signature(MECHANISMS[name].__init__).parameters
    plain = {k: t for k, t in option_types(name).items() if t in (bool, int, float, str)}
    for option, kind in plain.items():
        default = params[option].default
        for text in _texts(default):
            got = parse_option(name, option, text)
            assert type(got) is kind and got == default, (option, text, got)
        if kind in (bool, int, float):
            with pytest.raises(ConfigError, match=option) as err:
                parse_option(name, option, "maybe")
            _one_line(err.value)
    assert set(option_types(name)) <= set(mechanism_options(name))


@pytest.mark.parametrize("kind, text, value", [
    (bool, "true", True), (bool, "FALSE", False), (bool, "yes", True), (bool, "0", False),
    (int, "7", 7), (int, "1e3", 1000), (int, "20.0", 20), (int, "-3", -3),
    (int, "123456789012345678901", 123456789012345678901),
    (float, "2e1", 20.0), (float, "20", 20.0), (str, " a b ", " a b ")])
def test_parse_typed_reads_cli_text(kind, text, value):
    got = parse_typed("--x", text, kind)
    assert type(got) is kind and got == value


@pytest.mark.parametrize("kind, text, what", [
    (bool, "maybe", "true or false"), (bool, "", "true or false"), (int, "1.5", "an integer"),
    (int, "x", "an integer"), (int, "nan", "an integer"), (float, "inf", "a finite number"),
    (float, "nan", "a finite number"), (float, "[30]", "a finite number")])
def test_parse_typed_refuses_other_text(kind, text, what):
    with pytest.raises(ConfigError, match=f"--x must be {what}, got") as err:
        parse_typed("--x", text, kind)
    _one_line(err.value)


def test_declared_types_are_found():
    """The test above has options of every kind to read (qk-layernorm's divisor is a bool)."""
    kinds = {kind for name in NAMES for kind in option_types(name).values()}
    assert {bool, int, float, str} <= kinds


def _bool_option() -> tuple[str, str]:
    return next((name, option) for name in NAMES
                for option, kind in option_types(name).items() if kind is bool)


@pytest.mark.parametrize("words", _commands_with("--option"))
def test_every_option_flag_reads_booleans(cli, words):
    """Each command with --option reads a bool option by its type: a non-boolean is refused
    before any work, naming the option."""
    name, option = _bool_option()
    code, out, err = cli(*words, "--mechanism", name, "--option", f"{option}=maybe",
                         "--steps", "1")
    assert code == 2 and not out, err
    assert f"--option {option} must be true or false" in _one_line(err)


def test_train_records_a_false_boolean_option(cli):
    """attnscale train --option divisor=false trains with the boolean False, as lm does."""
    import json
    name, option = _bool_option()
    code, out, err = cli("train", "--mechanism", name, "--option", f"{option}=false",
                         "--steps", "2", "--d-k", "8", "--json")
    assert code == 0, err
    (run,) = json.loads(out)["runs"]
    assert run["config"]["options"] == {option: False}


# --- 6. Hugging Face: a swapped mechanism never runs on another implementation --------------

def _tiny_llama():
    import transformers  # the test extra has it: a missing one fails, never skips

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers, transformers.LlamaForCausalLM(config).eval()


def _change_by_method(model, implementation):
    model.set_attn_implementation(implementation)


def _change_by_config(model, implementation):
    model.config._attn_implementation = implementation


@pytest.mark.parametrize("change", [_change_by_method, _change_by_config],
                         ids=["set_attn_implementation", "config"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_hf_swapped_model_refuses_another_implementation(change, implementation):
    """After set_mechanism, switching the model to another implementation, by either route,
    makes the next forward a one-line ConfigError; switching back restores the same logits;
    removing the mechanism first allows the switch."""
    import attnscale.hf as hf
    _, model = _tiny_llama()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    hf.set_mechanism(model, "cosine")
    with torch.no_grad():
        swapped = model(ids).logits
        change(model, implementation)
        with pytest.raises(ConfigError, match=f"'cosine'.*runs '{implementation}'") as err:
            model(ids)
        _one_line(err.value)
        change(model, "attnscale")
        torch.testing.assert_close(model(ids).logits, swapped)
        hf.set_mechanism(model, None)
        change(model, implementation)
        native = model(ids).logits
    assert float((native - swapped).abs().max()) > 1e-3  # the mechanism did change them


def test_hf_config_naming_a_missing_mechanism_is_refused(tmp_path):
    """transformers' own from_pretrained drops a saved mechanism; on attn_implementation=
    'attnscale' the layer would run the native temperature while the config names the mechanism:
    refused, pointing at attnscale.hf.from_pretrained (which restores it).  attnscale's loader
    refuses another implementation outright."""
    import attnscale.hf as hf
    transformers, model = _tiny_llama()
    hf.set_mechanism(model, "cosine")
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    hf.register()
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="attnscale")
    with pytest.raises(ConfigError, match="attnscale.hf.from_pretrained") as err:
        plain(ids)
    _one_line(err.value)
    with pytest.raises(ConfigError, match="attn_implementation must be 'attnscale'"):
        hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path, attn_implementation="sdpa")
    restored = hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(restored(ids).logits, model(ids).logits)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": torch.int64}, "dtype must be a floating torch.dtype"),
    ({"dtype": "float32"}, "dtype must be a floating torch.dtype"),
    ({"device": "gpu"}, "device: 'gpu' is not a torch device"),
    ({"bias": "yes"}, "bias must be True or False")])
def test_multi_head_attention_construction_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        MultiHeadAttention(16, 2, **kwargs)
    _one_line(err.value)


def test_multi_head_attention_on_meta_builds_for_its_shapes():
    """device='meta' stays allowed for a module: it holds no data but has every shape."""
    mha = MultiHeadAttention(16, 2, device="meta")
    assert mha.w_q.weight.is_meta and mha.w_q.weight.shape == (16, 16)


@pytest.mark.parametrize("causal", ["no", 1, None])
def test_causal_must_be_a_boolean(causal):
    """causal="no" would be truthy: refused in the API and in MultiHeadAttention."""
    x = torch.randn(1, H, 3, D)
    with pytest.raises(ConfigError, match="causal must be True or False"):
        attnscale.attention(x, x, x, causal=causal)
    with pytest.raises(ConfigError, match="causal must be True or False"):
        MultiHeadAttention(16, 2)(torch.randn(1, 3, 16), causal=causal)
