"""attnscale inspect on tiny random models of every family attnscale runs: each statistic against an
independent recomputation from HF's own eager attention (``output_attentions=True``, with q and k
taken from the eager attention function's arguments), the owner per family, the drift against the
same architecture freshly initialised, the files, the CLI's errors, and no (B, H, N, N) tensor.

Everything is built from configs; nothing is downloaded.  The real checkpoint:
tests/test_inspect_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from attnscale import hf
from attnscale.columns import RECORD_STATS
from attnscale.errors import ConfigError
from attnscale.kernels import native, softmax_rows
from attnscale.inspect import FIELDS, inspect_checkpoint, inspect_model, redraw, render, write
from attnscale.inspect.inputs import fresh_model, reinitialise
from attnscale.inspect.measure import qk_totals
from attnscale.inspect.records import COMPARED
from attnscale.inspect.report import OUT_FILES, RECORDS, REPORT
from attnscale.measure.monitor import monitor
from attnscale.stats import coherence, logit_std, qk_row_factors, qk_row_stats

hf.register()

VOCAB, SEQ = 96, 24
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2)


def make_config(family: str):
    """Tiny configs, each with what makes its family's temperature its own."""
    if family == "llama":      # grouped-query attention
        return transformers.LlamaConfig(num_key_value_heads=2, **COMMON)
    if family == "mistral":    # a sliding window shorter than the sequence
        return transformers.MistralConfig(num_key_value_heads=2, sliding_window=8, **COMMON)
    if family == "qwen2":      # q/k/v biases, one key head
        return transformers.Qwen2Config(num_key_value_heads=1, **COMMON)
    if family == "qwen3":      # per-head q/k RMSNorm
        return transformers.Qwen3Config(num_key_value_heads=2, head_dim=8, **COMMON)
    if family == "gemma2":     # soft-cap, query_pre_attn_scalar != head_dim, a sliding layer
        return transformers.Gemma2Config(num_key_value_heads=2, head_dim=8,
                                         query_pre_attn_scalar=12, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=None, sliding_window=8,
                                         **COMMON)
    if family == "gemma3":     # per-head q/k RMSNorm and query_pre_attn_scalar
        return transformers.Gemma3TextConfig(num_key_value_heads=2, head_dim=8,
                                             query_pre_attn_scalar=12, sliding_window=8,
                                             **COMMON)
    if family == "olmo2":      # q/k RMSNorm over the full width
        return transformers.Olmo2Config(num_key_value_heads=4, **COMMON)
    if family == "gpt_oss":    # learned attention sinks, a sliding layer
        return transformers.GptOssConfig(
            num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON)
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "gpt_oss"]


def make_model(family: str, attn: str = "attnscale", dtype=torch.float64):
    if family == "gpt_oss" and dtype == torch.float64:
        dtype = torch.float32  # its experts' grouped matmul has no float64 kernel
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(make_config(family), attn_implementation=attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 2.0)    # learned gains that differ per channel
    return model.to(dtype).eval()


def ids(batch: int = 2, n: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def eager_calls(model):
    """Record (module, q, k, mask, kwargs, weights) of every call of the eager attention function
    of ``model``'s family (HF's own: the module global its forward looks up at call time)."""
    calls = []
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    patched = []
    for mod in modules:
        original = getattr(mod, "eager_attention_forward", None)
        if original is None:
            continue

        def wrapped(module, query, key, value, attention_mask, *args, _original=original,
                    **kwargs):
            out = _original(module, query, key, value, attention_mask, *args, **kwargs)
            calls.append({"module": module, "q": query, "k": key, "mask": attention_mask,
                          "kwargs": kwargs, "weights": out[1]})
            return out

        mod.eager_attention_forward = wrapped
        patched.append((mod, original))
    try:
        yield calls
    finally:
        for mod, original in patched:
            mod.eager_attention_forward = original


def reference(call: dict) -> dict[str, torch.Tensor]:
    """Per-head statistics of one eager call, computed directly in float64 from its weights and
    its q and k: the independent recomputation every inspect statistic is checked against."""
    q, k = call["q"].double(), call["k"].double()                    # (B, H, N, d), (B, Hk, N, d)
    h = q.shape[1]
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    d = q.shape[-1]
    mask = call["mask"]
    n = q.shape[-2]
    if mask is None:
        keep = torch.ones(1, 1, n, k.shape[-2], dtype=torch.bool)
    else:
        keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    keep = keep[..., :k.shape[-2]].expand(q.shape[0], h, n, k.shape[-2])
    p = call["weights"].double()                                     # (B, H, N, N)
    if "s_aux" in call["kwargs"]:                                    # gpt-oss: the sink's weight
        p = torch.cat([p, (1 - p.sum(-1, keepdim=True))], dim=-1)
    scaling = call["kwargs"].get("scaling") or d ** -0.5
    dots = q @ k.transpose(-2, -1)
    z = dots * scaling
    cap = call["kwargs"].get("softcap")
    if cap:
        z = cap * torch.tanh(z / cap)
    count = keep.sum(-1).double()                                    # (B, H, N)
    outcomes = count + ("s_aux" in call["kwargs"])                   # a sink: one outcome more

    def masked_std(x):
        mean = torch.where(keep, x, 0).sum(-1) / count
        var = torch.where(keep, (x - mean[..., None]) ** 2, 0).sum(-1) / (count - 1)
        return var.sqrt()

    entropy = -torch.special.xlogy(p, p).sum(-1)
    p2 = (p * p).sum(-1)
    jac = (p2 - 2 * (p ** 3).sum(-1) + p2 * p2).sqrt()
    k_ms = (keep.double() @ (k * k).sum(-1, keepdim=True)).squeeze(-1) / count
    coh = masked_std(dots) / (q.norm(dim=-1) * k_ms.sqrt() / math.sqrt(d))
    two = count >= 2
    coherent = two & (q.norm(dim=-1) != 0)   # a padding token's zero query has no coherence

    def mean(x, rows=None):
        rows = torch.ones_like(x, dtype=torch.bool) if rows is None else rows
        return torch.where(rows, x, 0).sum((0, 2)) / rows.sum((0, 2))

    return {"entropy_mean": mean(entropy), "max_weight_mean": mean(p.amax(-1)),
            # the monitor's logit std: 0 for a row with one key, as attnscale.stats.logit_std
            "jacobian_fro_mean": mean(jac), "logit_std": mean(torch.where(two, masked_std(z), 0)),
            "logit_absmax": torch.where(keep, z.abs(), 0).amax((0, 2, 3)),
            # ln of the outcomes the entropy covers: the keys, and the sink where there is one
            "mean_ln_keys": mean(outcomes.log()),
            "entropy_ratio": mean(entropy) / mean(outcomes.log()),
            "q_rms": mean(q.norm(dim=-1) / math.sqrt(d)), "k_rms": mean((k_ms / d).sqrt()),
            "coherence": mean(coh, coherent)}


# ---------------------------------------------------------------------------------------------
# coherence (attnscale.stats) and its blockwise totals


def test_coherence_equals_its_formula_and_is_scale_free():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 16, generator=g, dtype=torch.float64), \
        torch.randn(2, 3, 9, 16, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 3, 5, 9, generator=g) > 0.3
    mask[..., 0, :] = False
    mask[..., 0, 4] = True                                           # one key: undefined
    got = coherence(q, k, mask=mask)
    for b, h, i in [(0, 0, 1), (1, 2, 3), (0, 1, 4)]:
        keys = k[b, h][mask[b, h, i]]
        dots = keys @ q[b, h, i]
        want = dots.std() / (q[b, h, i].norm() * keys.norm(dim=-1).pow(2).mean().sqrt() / 4)
        torch.testing.assert_close(got[b, h, i], want)
    assert torch.isnan(got[..., 0]).all()
    torch.testing.assert_close(coherence(3 * q, 0.25 * k, mask=mask), got, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qk_row_stats_split_the_logit_std_and_limit_is_a_causal_mask(dtype):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 11, 8, generator=g, dtype=dtype) * 3
    k = torch.randn(2, 3, 11, 8, generator=g, dtype=dtype) + 0.5
    tri = torch.ones(11, 11, dtype=torch.bool).tril()
    limit = torch.arange(1, 12)
    by_mask, by_limit = qk_row_stats(q, k, mask=tri), qk_row_stats(q, k, limit=limit)
    for key in by_mask:
        torch.testing.assert_close(by_limit[key], by_mask[key], equal_nan=True)
    scale = 0.3
    z = (scale * q @ k.transpose(-2, -1)).masked_fill(~tri, -math.inf)
    split = scale * math.sqrt(8) * by_mask["q_rms"] * by_mask["k_rms"] * by_mask["coherence"]
    torch.testing.assert_close(split[..., 1:], logit_std(z).double()[..., 1:],
                               rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0)
    assert torch.isnan(by_mask["coherence"][..., 0]).all()           # one key: undefined
    torch.testing.assert_close(by_mask["count"][0, 0], limit.double())


def test_coherence_is_one_for_independent_and_sqrt_d_for_aligned_keys():
    g = torch.Generator().manual_seed(1)
    d, n, rows = 64, 128, 1024
    q = torch.randn(rows, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(rows, n, d, generator=g, dtype=torch.float64)
    c = coherence(q, k).flatten()
    # Independent Gaussian q and k: 1 up to the sample std's small bias (c4(n) - 1 ~ -1/(4n))
    # and the rms's sampling error; the band is the mean's own standard error.
    se = c.std() / math.sqrt(rows)
    assert abs(c.mean() - 1) < 4 * se + 1 / (4 * n), (c.mean(), se)
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(n // 2)
    aligned = 2.5 * signs[None, :, None] * q / q.norm(dim=-1, keepdim=True)   # ±c q/|q|
    want = math.sqrt(d) * math.sqrt(n / (n - 1))
    torch.testing.assert_close(coherence(q, aligned).flatten(),
                               torch.full((rows,), want, dtype=torch.float64))


@pytest.mark.parametrize("causal", [False, True])
def test_qk_totals_do_not_depend_on_the_block(causal):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 37, 8, generator=g)
    k = torch.randn(2, 2, 37, 8, generator=g)                         # grouped-query
    mask = torch.rand(2, 1, 37, 37, generator=g) > 0.2
    whole = qk_totals(q, k, mask=mask, causal=causal, block=64).means()
    for block in (1, 5, 16):
        part = qk_totals(q, k, mask=mask, causal=causal, block=block).means()
        for key, value in whole.items():
            torch.testing.assert_close(torch.tensor(part[key]), torch.tensor(value))


def test_qk_totals_read_an_additive_mask_as_its_masked_keys():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 9, 4, generator=g), torch.randn(1, 2, 9, 4, generator=g)
    keep = torch.rand(1, 1, 9, 9, generator=g) > 0.3
    bias = torch.where(keep, torch.randn(1, 1, 9, 9, generator=g), -math.inf)  # ALiBi-like
    want, got = qk_totals(q, k, mask=keep).means(), qk_totals(q, k, mask=bias).means()
    for key in want:
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]))


@pytest.mark.parametrize("causal", [False, True])
def test_qk_row_factors_from_a_known_std_equal_qk_row_stats(causal):
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 3, 11, 8, generator=g), torch.randn(2, 3, 11, 8, generator=g)
    k[0, 1, 2:5] = 0.0                                                # rows with a zero key
    mask = torch.rand(2, 1, 11, 11, generator=g) > 0.3
    limit = torch.arange(1, 12) if causal else None
    want = qk_row_stats(q, k, mask=mask, limit=limit)
    seen = mask & (torch.arange(11) < limit.unsqueeze(-1)) if causal else mask
    seen = seen.expand(2, 3, 11, 11)
    n = seen.sum(-1).double()
    dots = (q @ k.transpose(-2, -1)).double().masked_fill(~seen, 0.0)
    mean = dots.sum(-1) / n.clamp(min=1)
    var = ((dots - mean.unsqueeze(-1)) ** 2).masked_fill(~seen, 0.0).sum(-1) / (n - 1)
    std = torch.where(n >= 2, var.sqrt(), math.nan)                 # Bessel-corrected
    got = qk_row_factors(q, k, std, seen.sum(-1), mask=mask, limit=limit)
    for key in ("count", "q_rms", "k_rms", "coherence"):
        torch.testing.assert_close(got[key], want[key].double(), rtol=1e-5, atol=1e-7,
                                   equal_nan=True, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_coherence_from_the_kernels_rows_equals_the_recomputation(family, monkeypatch):
    """On a float32 model the pipeline's kernel hands over each row's logit std, and the q/k
    factors are taken from it; forcing the recomputation from q and k gives the same records."""
    measure_module = sys.modules["attnscale.inspect.measure"]
    model = make_model(family, dtype=torch.float32)
    tokens = ids()
    used = []
    real = measure_module.qk_row_factors
    monkeypatch.setattr(measure_module, "qk_row_factors",
                        lambda *a, **kw: used.append(1) or real(*a, **kw))
    fast = measure_module.measure(model, {"input_ids": tokens}, block=7).records
    assert used                                       # the rows' path was taken
    monkeypatch.setattr(measure_module, "_plain_logits", lambda seen: False)
    used.clear()
    slow = measure_module.measure(model, {"input_ids": tokens}, block=7).records
    assert not used
    for key in ("q_rms", "k_rms", "coherence", "coherent_rows", "mean_ln_keys", "n_keys"):
        torch.testing.assert_close(torch.tensor([r[key] for r in fast], dtype=torch.float64),
                                   torch.tensor([r[key] for r in slow], dtype=torch.float64),
                                   rtol=2e-5, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")


def test_the_monitor_hands_each_call_to_on_call_under_its_record_name():
    model = make_model("llama", dtype=torch.float32)
    sites = []
    with torch.no_grad(), monitor(model, on_call=lambda site, seen: sites.append(
            (site, tuple(seen.q.shape)))) as mon:
        model(input_ids=ids())
    assert [s for s, _ in sites] == list(dict.fromkeys(r["module"] for r in mon.records))
    assert all(shape == (2, 4, SEQ, 8) for _, shape in sites)
    with pytest.raises(ConfigError, match="on_call must be callable"):
        monitor(model, on_call=3)


# ---------------------------------------------------------------------------------------------
# every statistic against HF's eager attention, on every family


@pytest.mark.parametrize("family", FAMILIES)
def test_every_statistic_equals_eager_recomputation(family):
    model = make_model(family)
    tokens = ids()
    result = inspect_model(model, tokens, init=False)
    eager = make_model(family, attn="eager")
    with torch.no_grad(), eager_calls(eager) as calls:
        eager(input_ids=tokens, output_attentions=True)
    assert len(calls) == result["summary"]["layers"] == COMMON["num_hidden_layers"]
    tol = ({"rtol": 1e-6, "atol": 1e-9} if model.dtype == torch.float64 else
           {"rtol": 1e-4, "atol": 1e-6})
    names = {m: n for n, m in eager.named_modules()}
    for layer, call in enumerate(calls):
        want = reference(call)
        rows = [r for r in result["records"] if r["layer"] == layer]
        assert rows[0]["module"] == names[call["module"]]
        for key, values in want.items():
            got = torch.tensor([r[key] for r in rows], dtype=torch.float64)
            # HF's eager softmax runs in float32 even for a float64 model: its weights carry
            # float32 rounding, everything else float64 (gpt-oss runs in float32 throughout).
            torch.testing.assert_close(got, values, **tol,
                                       msg=lambda m, key=key: f"{family} layer {layer} {key}: {m}")
    assert all(list(r) == list(FIELDS) for r in result["records"])
    assert set(RECORD_STATS) <= set(FIELDS)          # every monitor statistic reaches the report


OWNERS = {
    "llama": ("the divisor (scale 1/sqrt(d_head) = 1/sqrt(8)) in every layer", "`scaled`"),
    "gemma2": ("query_pre_attn_scalar^-1/2 = 12^-1/2) and a soft-cap at 2 in every layer",
               "`scaled`, `softcap`"),
    "qwen3": ("the q/k normalisation per head and its learned gains", "`qk-rmsnorm(over=head)`"),
    "olmo2": ("the q/k normalisation over the full width", "`qk-rmsnorm(over=model)`"),
    "gemma3": ("per head and its learned gains (then scale query_pre_attn_scalar^-1/2 = 12^-1/2)",
               "`qk-rmsnorm(over=head)`"),
    "gpt_oss": ("and learned attention sinks in every layer", "`scaled`, `sink`"),
}


@pytest.mark.parametrize("family", sorted(OWNERS))
def test_the_owner_is_named_per_family(family):
    result = inspect_model(make_model(family, dtype=torch.float32), ids(1), init=False)
    phrase, mechanisms = OWNERS[family]
    assert phrase in result["owner"] and f"(attnscale: {mechanisms})" in result["owner"], \
        result["owner"]
    layer = result["layers"][0]
    if family in ("qwen3", "olmo2"):   # the gains' spread, as set in make_model
        assert 0.5 <= layer["q_gain"]["min"] < layer["q_gain"]["max"] <= 2.0
    if family == "gemma3":             # Gemma's RMSNorm multiplies by 1 + w
        assert 1.5 <= layer["q_gain"]["min"] < layer["q_gain"]["max"] <= 3.0


def test_owner_of_a_swapped_model_and_the_whatif_side_by_side():
    model = make_model("llama", dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = inspect_model(model, ids(1), init=False, whatif="qk-rmsnorm")
    rows = result["records"]
    assert all(r["whatif_coherence"] is not None for r in rows)
    assert result["summary"]["median_whatif_q_rms"] == pytest.approx(1.0, rel=0.05)  # RMS-normed
    assert "## What if: `qk-rmsnorm`" in render(result)
    after = model.state_dict()                                       # the model is as it was
    assert set(after) == set(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    hf.set_mechanism(model, "mup")
    swapped = inspect_model(model, ids(1), init=False)
    assert "swapped-in mechanism 'mup'" in swapped["owner"] and "`mup`" in swapped["owner"]


# ---------------------------------------------------------------------------------------------
# drift: the same architecture freshly initialised by its own _init_weights


def test_init_statistics_are_the_fresh_architecture_measured_independently():
    model = make_model("llama", dtype=torch.float32)
    tokens = ids()
    result = inspect_model(model, tokens, seed=7)
    torch.manual_seed(123)                                           # the global stream is kept
    state = torch.random.get_rng_state()
    fresh_model(model, 7)
    assert torch.equal(torch.random.get_rng_state(), state)
    fresh = reinitialise(transformers.AutoModel.from_config(        # built here on its own
        model.config, attn_implementation="eager"), 7)
    with torch.no_grad(), eager_calls(fresh) as calls:
        fresh(input_ids=tokens, output_attentions=True)
    for layer, call in enumerate(calls):
        want = reference(call)
        rows = [r for r in result["records"] if r["layer"] == layer]
        for key in COMPARED:
            torch.testing.assert_close(torch.tensor([r[f"init_{key}"] for r in rows],
                                                    dtype=torch.float64), want[key],
                                       rtol=2e-5, atol=1e-7)
            torch.testing.assert_close(
                torch.tensor([r[f"drift_{key}"] for r in rows], dtype=torch.float64),
                torch.tensor([r[key] / r[f"init_{key}"] for r in rows], dtype=torch.float64))


def test_summary_states_the_premise_and_the_calibration():
    model = make_model("llama", dtype=torch.float32)
    s = inspect_model(model, ids(), seed=0)["summary"]
    # initializer_range 0.2 at width 32: q components of rms about 0.2 * sqrt(32) ~ 1.1
    assert s["premise_at_init"] == (0.5 <= s["median_init_q_rms"] <= 2
                                    and 0.5 <= s["median_init_k_rms"] <= 2)
    torch.manual_seed(0)
    narrow = transformers.AutoModel.from_config(
        transformers.LlamaConfig(**{**COMMON, "initializer_range": 0.01}),
        attn_implementation="attnscale").eval()
    result = inspect_model(narrow, ids(), seed=0)
    assert result["summary"]["premise_at_init"] is False
    assert "never met the footnote's premise" in render(result)
    assert "never calibrated, even at step 0" in render(result)


# ---------------------------------------------------------------------------------------------
# files: records.json, report.md, figures; redrawn from the store


def test_files_are_written_and_redrawn_byte_for_byte(tmp_path):
    result = inspect_model(make_model("gemma2", dtype=torch.float32), ids(1), whatif="mup")
    out = write(result, tmp_path / "r")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(OUT_FILES)
    stored = json.loads((out / RECORDS).read_text())
    assert stored["fields"] == FIELDS and len(stored["records"]) == 2 * 4
    report = (out / REPORT).read_text()
    assert report.startswith("# Temperature report") and "**Verdict.**" in report.splitlines()[2]
    for field in FIELDS:
        assert f"| `{field}` |" in report
    first = report
    (out / REPORT).unlink()
    redraw(out)
    assert (out / REPORT).read_text() == first
    for name in OUT_FILES[2:]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dtype_is_the_models_and_statistics_are_float32(tmp_path):
    model = make_model("llama", dtype=torch.bfloat16)
    result = inspect_model(model, ids(1), init=True)
    assert result["meta"]["dtype"] == "bfloat16"
    ref = inspect_model(make_model("llama", dtype=torch.float32), ids(1), init=False)
    for a, b in zip(result["records"], ref["records"]):   # bf16 weights, float32 statistics
        assert a["coherence"] == pytest.approx(b["coherence"], rel=0.1)
        assert a["entropy_mean"] == pytest.approx(b["entropy_mean"], rel=0.05)


# ---------------------------------------------------------------------------------------------
# no (B, H, N, N) tensor


class OutputShapes(TorchDispatchMode):
    """Every (shape, floating?) a torch op returns while active (SDPA's fused kernel is one op,
    so what it holds inside is not a tensor the program formed)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = out if isinstance(out, (tuple, list)) else (out,)
        self.shapes.update((tuple(t.shape), t.is_floating_point()) for t in tensors
                           if isinstance(t, torch.Tensor))
        return out


def test_no_op_forms_a_batch_heads_by_n_by_n_tensor(monkeypatch):
    n, block = 512, 32
    # the blockwise softmax kernel (no_grad forwards) holds blocks of this many logits; its C
    # loop, a block's logits and weights on each of up to 2 threads
    monkeypatch.setattr(softmax_rows, "ROWS_BLOCK_ELEMENTS", block * n)
    monkeypatch.setattr(native, "NATIVE_BLOCK_ROWS", block // 4)
    config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": n,
                                         "num_key_value_heads": 4})
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="attnscale").eval()
    with OutputShapes() as seen:
        inspect_model(model, ids(1, n), block=block)
    heads = COMMON["num_attention_heads"]
    # No (B, H, N, N) tensor of any dtype (a (1, 1, N, N) boolean causal mask, as HF's mask
    # function may build, is one head's worth), and no floating tensor beyond one block's
    # (B, H, block, N) logits.
    assert max(math.prod(s) for s, _ in seen.shapes) < heads * n * n
    largest = max(math.prod(s) for s, floating in seen.shapes if floating)
    assert largest <= heads * block * n < heads * n * n // 8, largest


# ---------------------------------------------------------------------------------------------
# the command line


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved without a tokenizer, and one with a BERT-style word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("inspect")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 40})
    transformers.LlamaModel(config).save_pretrained(root / "bare")
    transformers.LlamaModel(config).save_pretrained(root / "tokenized")
    words = ["[UNK]"] + [chr(97 + i) * (1 + i // 26) for i in range(VOCAB - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        root / "tokenized")
    return root


def test_cli_writes_the_report_and_prints_the_verdict(cli, saved, tmp_path):
    code, out, err = cli("inspect", str(saved / "bare"), "--seq-len", "16", "--out",
                         str(tmp_path / "r"), "--name", "tiny")
    assert code == 0, err
    assert out.startswith("The attention temperature of this llama model is owned by")
    stored = json.loads((tmp_path / "r" / RECORDS).read_text())
    assert stored["meta"]["name"] == "tiny" and "random token ids" in stored["meta"]["input"]
    code, _, err = cli("inspect", "--from", str(tmp_path / "r"))
    assert code == 0, err
    code, out, err = cli("inspect", str(saved / "tokenized"), "--seq-len", "16", "--out",
                         str(tmp_path / "j"), "--json", "--no-init")
    assert code == 0, err
    payload = json.loads(out)
    assert "LICENSE.txt" in payload["meta"]["input"] or "stdlib" in payload["meta"]["input"]
    assert payload["records"][0]["init_logit_std"] is None


@pytest.mark.parametrize("case, fragment", [
    ("missing-folder", "does not exist"),
    ("no-weights", "has no weights"),
    ("seq-len-0", "--seq-len must be >= 1"),
    ("empty-text", "is empty"),
    ("short-text", "gives 3 tokens, fewer than --seq-len 16"),
    ("foreign-out", "attnscale did not write"),
    ("seq-len-too-long", "--seq-len 41 exceeds the model's maximum of 40"),
    ("unknown-mechanism", "--mechanism: Unknown mechanism 'qknrom'"),
    ("from-and-model", "--from DIR redraws"),
    ("nothing", "give PATH"),
    ("bad-threshold", "--saturated-weight must be in (0, 1)"),
    ("text-without-tokenizer", "--text was given, but the model folder has no tokenizer"),
    ("bad-device", "argument --device: 'nope' is not a torch device"),
])
def test_cli_bad_inputs_are_one_line_errors_with_exit_2(cli, saved, tmp_path, case, fragment):
    model = saved / "tokenized"
    argv = [str(model), "--seq-len", "16", "--out", str(tmp_path / "out")]
    if case == "missing-folder":
        argv[0] = str(tmp_path / "nope")
    elif case == "no-weights":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text((model / "config.json").read_text())
        argv[0] = str(tmp_path / "m")
    elif case == "seq-len-0":
        argv[2] = "0"
    elif case in ("empty-text", "short-text"):
        (tmp_path / "t.txt").write_text("  \n" if case == "empty-text" else "a b c")
        argv += ["--text", str(tmp_path / "t.txt")]
    elif case == "foreign-out":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "report.md").write_text("mine")
    elif case == "seq-len-too-long":
        argv[2] = "41"
    elif case == "unknown-mechanism":
        argv += ["--mechanism", "qknrom"]
    elif case == "from-and-model":
        argv += ["--from", str(tmp_path)]
    elif case == "nothing":
        argv = []
    elif case == "bad-threshold":
        argv += ["--saturated-weight", "1.5"]
    elif case == "bad-device":
        argv += ["--device", "nope"]
    elif case == "text-without-tokenizer":
        (tmp_path / "t.txt").write_text("a b c " * 20)
        argv = [str(saved / "bare"), *argv[1:], "--text", str(tmp_path / "t.txt")]
    code, out, err = cli("inspect", *argv)
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err and fragment in err, err
    if case == "foreign-out":
        assert (tmp_path / "out" / "report.md").read_text() == "mine"
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.md"]
    else:
        assert not (tmp_path / "out").exists()


def test_a_family_outside_the_interface_is_refused_in_one_line(tmp_path):
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    transformers.BloomModel(config).save_pretrained(tmp_path / "bloom")
    with pytest.raises(ConfigError, match="model family .bloom. cannot be inspected: no layer") as err:
        inspect_checkpoint(tmp_path / "bloom", seq_len=8)
    assert "\n" not in str(err.value)


def test_a_progress_bar_counts_the_layers_of_every_pass(monkeypatch):
    import attnscale.inspect as engine

    class Bar:
        def __init__(self, iterable, *, desc, total=None, enabled=None):
            self.desc, self.total, self.n, self.closed = desc, total, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def refresh(self):
            pass

        def close(self):
            self.closed = True

    bars = []
    monkeypatch.setattr(engine, "progress", Bar)
    engine.inspect_model(make_model("llama", dtype=torch.float32), ids(1), whatif="mup")
    (bar,) = bars
    assert bar.desc == "inspect: layers" and bar.closed
    assert bar.n == bar.total == 3 * COMMON["num_hidden_layers"]  # checkpoint, what-if, init
