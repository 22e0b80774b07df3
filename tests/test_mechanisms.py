"""The mechanism registry: every mechanism against its formula, options, and MultiHeadAttention."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from attnscale.attention import MultiHeadAttention
from attnscale.attention import attention as attnscale_attention
from attnscale.errors import ConfigError
from attnscale.mechanisms import MECHANISMS, Mechanism, build_mechanism, mechanism_options, register
from attnscale.mechanisms.cosine import TAU_INIT, TAU_MAX
from attnscale.mechanisms import qk_layernorm
from attnscale.mechanisms.qk_rmsnorm import RMS_EPS
from attnscale.mechanisms.qknorm import DEFAULT_MAX_LEN
from attnscale.mechanisms.rownorm import rms_rows, unit_rows
from attnscale.mechanisms.sigma_reparam import SigmaReparam
from attnscale.mechanisms.softcap import GEMMA2_CAP, GROK1_CAP
from attnscale.mechanisms.ssmax import S_INIT
from attnscale.pipeline import NORMALISERS, apply_rule

B, H, NQ, NK, D = 2, 3, 5, 7, 8
# torch.nn.LayerNorm's default epsilon, which qk-layernorm's norms keep (written here, not read
# from the module, so that the formula row checks it).
LN_EPS = 1e-5


def _qk(seed=0, scale=1.0, nk=NK):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, NQ, D, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(B, H, nk, D, generator=gen, dtype=torch.float64) * scale
    return q, k


def _n(k):
    """The keys every query attends in the formula table (no mask): Nk."""
    return k.shape[-2]


def _unit(x):
    return x / x.pow(2).sum(-1, keepdim=True).sqrt()


def _layer_norm(x, dims):
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).pow(2).mean(dims, keepdim=True)
    return (x - mean) / (var + LN_EPS).sqrt()


def _rms_norm(x):
    return x / (x.pow(2).mean(-1, keepdim=True) + RMS_EPS).sqrt()


def _affine(x, norm):
    """Apply a LayerNorm module's learned gain and bias to an already normalised x."""
    return x * norm.weight + norm.bias


# Each formula written out in float64 from the README's mechanism table (each mechanism's paper),
# independently of the modules: one
# row per mechanism, the only place a new mechanism's name appears in the tests.
# ``m`` is the built module, read only for its learned parameters.
def _dot(q, k):
    return q @ k.transpose(-2, -1)


FORMULAS = {
    "scaled": lambda q, k, m: _dot(q, k) / math.sqrt(D),
    "unscaled": lambda q, k, m: _dot(q, k),
    "init-reparam": lambda q, k, m: _dot(q, k),
    "qknorm": lambda q, k, m: m.g * _dot(_unit(q), _unit(k)),
    "qk-layernorm": lambda q, k, m: _dot(_affine(_layer_norm(q, -1), m.q_norm),
                                        _affine(_layer_norm(k, -1), m.k_norm)) / math.sqrt(D),
    "qk-rmsnorm": lambda q, k, m: _dot(_rms_norm(q) * m.q_gain, _rms_norm(k) * m.k_gain)
    / math.sqrt(D),
    "cosine": lambda q, k, m: torch.exp(m.tau.clamp(max=math.log(100))) * _dot(_unit(q), _unit(k)),
    "learned-temp": lambda q, k, m: torch.exp(m.beta) * _dot(q, k),
    "mup": lambda q, k, m: _dot(q, k) / D,
    "softcap": lambda q, k, m: 50.0 * torch.tanh(_dot(q, k) / math.sqrt(D) / 50.0),
    "yarn": lambda q, k, m: (0.1 * math.log(4.0) + 1) ** 2 * _dot(q, k) / math.sqrt(D),  # factor 4
    "sigma-reparam": lambda q, k, m: _dot(q, k) / math.sqrt(D),
    "ssmax": lambda q, k, m: m.s * math.log(_n(k)) * _dot(q, k) / math.sqrt(D),
    "llama4-temp": lambda q, k, m: (0.1 * math.log1p(_n(k) // 8192) + 1) * _dot(q, k)
    / math.sqrt(D),
    "qk-clip": lambda q, k, m: _dot(q, k) / math.sqrt(D),  # it acts on W_Q, W_K between steps
    "logn": lambda q, k, m: max(1.0, math.log(_n(k)) / math.log(2048)) * _dot(q, k)
    / math.sqrt(D),
    "sink": lambda q, k, m: _dot(q, k) / math.sqrt(D),     # the sink enters the normaliser
    "sigmoid": lambda q, k, m: _dot(q, k) / math.sqrt(D) - math.log(_n(k)),  # b = -ln n
    "adaptive-temp": lambda q, k, m: _beta(_entropy(_dot(q, k) / math.sqrt(D)))
    * _dot(q, k) / math.sqrt(D),
    "gated": lambda q, k, m: _dot(q, k) / math.sqrt(D),    # the gate acts on the output
    "clip-qkv": lambda q, k, m: _dot(q.clamp(-8, 8), k.clamp(-8, 8)) / math.sqrt(D),
    "softpick": lambda q, k, m: _dot(q, k) / math.sqrt(D),       # the rule is its normaliser
    "stick-breaking": lambda q, k, m: _dot(q, k) / math.sqrt(D),  # the rule is its normaliser
    "mscale": lambda q, k, m: (0.1 * math.log(4.0) + 1) ** 2 * _dot(q, k) / math.sqrt(D),
    # without the layer input there are no forget gates (f = 1); tests/test_forgetting.py has FoX
    "forgetting": lambda q, k, m: _dot(q, k) / math.sqrt(D),
    "selective": lambda q, k, m: _dot(q, k) / math.sqrt(D) - _selection(q, k)[:, None],
    # the two maps of the halves of q and k, side by side
    "differential": lambda q, k, m: torch.cat([_dot(q[..., :D // 2], k[..., :D // 2]),
                                               _dot(q[..., D // 2:], k[..., D // 2:])], -1)
    / math.sqrt(D // 2),
}
# Where a row is checked at other inputs than the default (B, H, NQ, NK, D) draw, or with
# options: at 7 keys llama4-temp (steps every 8192 keys) and logn (past 2048) are scaled, clip-qkv's
# clamp at 8 touches no unit-normal entry, and yarn and mscale are scaled at factor 1.
ROW_INPUTS = {"llama4-temp": {"nk": 2 * 8192 + 3}, "logn": {"nk": 4096},
              "clip-qkv": {"scale": 6.0}}
ROW_OPTIONS = {"yarn": {"factor": 4.0}, "mscale": {"factor": 4.0}}
# Rows whose logits are scaled's by design: the rule acts on W_Q and W_K (sigma-reparam, qk-clip),
# on the normaliser (sink, softpick, stick-breaking), on the output (gated) or through the layer
# input's forget gates, which a formula row does not have (forgetting: tests/test_forgetting.py).
SCALED_LOGITS = {"scaled", "sigma-reparam", "qk-clip", "sink", "gated", "softpick",
                 "stick-breaking", "forgetting"}


def _row(name):
    """The built mechanism (float64) and the q, k its formula row is checked at."""
    m = build_mechanism(name, D, H, **ROW_OPTIONS.get(name, {})).double()
    return m, *_qk(**ROW_INPUTS.get(name, {}))


def _move(m, seed=1):
    """Every learned parameter of ``m`` moved away from its init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _selection(q, k):
    """F_ij = Σ_{j<k<i} max(0, z⁰_kj) over the first head's logits, keys j >= 1 (arXiv
    2410.02703), as an explicit sum: (B, Nq, Nk)."""
    z0 = _dot(q[:, 0], k[:, 0]) / math.sqrt(D)
    n_q, n_k = z0.shape[-2:]
    f = torch.zeros_like(z0)
    for i in range(n_q):
        for j in range(1, n_k):
            for kk in range(j + 1, i):
                f[:, i, j] += z0[:, kk, j].clamp(min=0)
    return f


def _entropy(z):
    """Shannon entropy (nats) of softmax(z) over the last dimension, (..., 1)."""
    p = torch.softmax(z, dim=-1)
    log_p = torch.log_softmax(z, dim=-1).masked_fill(p == 0, 0.0)  # 0 · ln 0 = 0, also in grad
    return -(p * log_p).sum(-1, keepdim=True)


def _beta(h):
    """Veličković et al. 2024, Figure 4: β = max(1, -0.037 H^4 + 0.481 H^3 - 2.3 H^2 + 4.917 H
    - 1.791) for H > 0.5, else 1 (jnp.polyval takes the highest power first)."""
    poly = -0.037 * h**4 + 0.481 * h**3 - 2.3 * h**2 + 4.917 * h - 1.791
    return torch.where(h > 0.5, poly.clamp(min=1.0), torch.ones_like(h))


def test_every_registered_mechanism_has_a_formula_row():
    assert set(FORMULAS) == set(MECHANISMS), "every registered mechanism needs a formula row"


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_mechanism_matches_its_formula_in_float64(name):
    m, q, k = _row(name)
    assert_close(m.logits(q, k), FORMULAS[name](q, k, m), rtol=1e-12, atol=1e-12)
    # Move any learned parameter away from its init: the formula must still hold.
    _move(m)
    assert_close(m.logits(q, k), FORMULAS[name](q, k, m), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(set(MECHANISMS) - SCALED_LOGITS))
def test_each_formula_row_is_checked_where_its_rule_acts(name):
    """At its inputs (and with its learned parameters moved), every row whose logits are not
    scaled's by design differs from scaled's far beyond the comparison's tolerance, so a
    mechanism that silently computed scaled's logits would fail its row."""
    m, q, k = _row(name)
    _move(m)
    with torch.no_grad():
        row, scaled = FORMULAS[name](q, k, m), FORMULAS["scaled"](q, k, m)
        if row.shape[-1] == 2 * scaled.shape[-1]:  # two maps side by side (differential)
            scaled = torch.cat([scaled, scaled], dim=-1)
        gap = (row - scaled).abs().max()
    assert float(gap) > 1e-6, f"{name}: its row equals scaled's at these inputs"


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_mechanism_declares_its_kind_and_cites_its_source(name):
    cls = MECHANISMS[name]
    assert cls.name == name
    m = build_mechanism(name, D, H)
    assert isinstance(cls.defined_at_init, bool) and isinstance(m.scale_only, bool)
    assert m.normaliser in NORMALISERS
    for flag in ("gate", "bilinear", "per_key", "normalises_qk", "has_offset", "acts_on_values"):
        assert isinstance(getattr(cls, flag), bool), flag
    # scale_only is derived: exactly what SDPA computes on the prepared q and k.
    if m.scale_only:
        q, k = _qk()
        v = torch.randn(B, H, NK, D, dtype=torch.float64)
        qs, ks, scale, _ = apply_rule(m.double(), q, k, NK, None, False)
        want = torch.nn.functional.scaled_dot_product_attention(qs * scale, ks, v, scale=1.0)
        assert_close(m(q, k, v), want)
    # The temperature lives in W_Q and W_K exactly when the mechanism acts on them at build.
    assert cls.defined_at_init == (cls.init_projections is Mechanism.init_projections)
    doc = cls.__doc__ or ""
    assert "Source" in doc and "=" in doc, f"{name}: docstring must state formula and source"


def test_defaults_match_their_papers():
    q, k = _qk()
    assert qk_layernorm.LN_EPS == LN_EPS
    assert GEMMA2_CAP == 50.0 and GROK1_CAP == 30.0 and S_INIT == 0.43
    assert TAU_INIT == math.log(10) and TAU_MAX == math.log(100) and RMS_EPS == 1e-6
    assert build_mechanism("qknorm", D, H).g.item() == pytest.approx(math.log2(128**2 - 128))
    assert DEFAULT_MAX_LEN == 128
    assert_close(build_mechanism("learned-temp", D, H).double().logits(q, k),
                 build_mechanism("scaled", D, H).logits(q, k))
    assert_close(build_mechanism("softcap", D, H, cap=GROK1_CAP).logits(q * 40, k * 40).abs().max(),
                 torch.tensor(GROK1_CAP, dtype=torch.float64), atol=1e-6, rtol=0)


def test_options_change_the_temperature():
    q, k = _qk()
    s = _dot(q, k) / math.sqrt(D)
    assert_close(build_mechanism("mup", D, H, alpha=2.0).logits(q, k), 2 * _dot(q, k) / D)
    m = 0.1 * math.log(4.0) + 1
    assert_close(build_mechanism("yarn", D, H, factor=4.0).logits(q, k), m * m * s)
    assert_close(build_mechanism("yarn", D, H, factor=0.5).logits(q, k), s)  # m = 1 if factor <= 1
    assert_close(build_mechanism("softcap", D, H, cap=2.0).logits(q, k), 2.0 * torch.tanh(s / 2))
    g = build_mechanism("qknorm", D, H, max_len=16).g
    assert g.item() == pytest.approx(math.log2(16 * 15))
    over_model = build_mechanism("qk-layernorm", D, H, over="model").double()
    flat = _layer_norm(q.transpose(1, 2).reshape(B, NQ, H * D), -1)  # LN over d_model
    q_ln = flat.view(B, NQ, H, D).transpose(1, 2)
    flat_k = _layer_norm(k.transpose(1, 2).reshape(B, NK, H * D), -1)
    k_ln = flat_k.view(B, NK, H, D).transpose(1, 2)
    assert_close(over_model.logits(q, k), _dot(q_ln, k_ln) / math.sqrt(D))


def test_cosine_temperature_is_clamped_and_kept_from_weight_decay():
    m = build_mechanism("cosine", D, H).double()
    with torch.no_grad():
        m.tau.fill_(10.0)
    q, k = _qk()
    assert_close(m.logits(q, k), 100.0 * _dot(_unit(q), _unit(k)))
    assert m.no_weight_decay() == {"tau"}
    mha = MultiHeadAttention(H * D, H, "cosine")
    names = dict(mha.named_parameters())
    assert mha.no_weight_decay() == {"mechanism.tau"} and "mechanism.tau" in names
    assert MultiHeadAttention(H * D, H).no_weight_decay() == set()


def test_row_norm_backward_matches_autograd():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.rand(3, 1, 1, generator=gen, dtype=torch.float64, requires_grad=True)
    scalar = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
    gain = torch.rand(5, generator=gen, dtype=torch.float64, requires_grad=True)
    for fn, args in ((unit_rows, (x,)), (unit_rows, (x, head)), (unit_rows, (x, scalar)),
                     (lambda x, g: rms_rows(x, g, RMS_EPS), (x, gain))):
        assert torch.autograd.gradcheck(fn, args)
    assert_close(unit_rows(x, head), head * x / x.norm(dim=-1, keepdim=True))
    assert_close(rms_rows(x, gain, RMS_EPS), gain * x / (x.pow(2).mean(-1, keepdim=True)
                                                       + RMS_EPS).sqrt())
    assert torch.equal(unit_rows(torch.zeros(2, 3)), torch.zeros(2, 3))  # zero rows stay zero


def test_ssmax_counts_the_keys_each_query_attends():
    m = build_mechanism("ssmax", D, H).double()
    q, k = _qk()
    n_keys = torch.tensor([1, 2, 3, 4, 7], dtype=torch.long).view(NQ, 1)
    z = m.logits(q, k, n_keys)
    expected = S_INIT * torch.log(n_keys.double()) * _dot(q, k) / math.sqrt(D)
    assert_close(z, expected)


def test_register_rejects_duplicates():
    before = dict(MECHANISMS)

    class Again(Mechanism):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register("scaled")(Again)
    assert MECHANISMS == before


def test_unknown_name_and_option_suggest_the_closest():
    with pytest.raises(ConfigError, match=r"Unknown mechanism 'qk_nrom'\. Did you mean: qknorm\?"):
        build_mechanism("qk_nrom", D, H)
    with pytest.raises(ConfigError, match=r"Unknown option 'caps' .*softcap.*Did you mean: cap\?"):
        build_mechanism("softcap", D, H, caps=30)
    with pytest.raises(ConfigError, match="takes no options"):
        build_mechanism("scaled", D, H, cap=30)
    with pytest.raises(ConfigError, match=r"over.*Did you mean: model\?"):
        build_mechanism("qk-layernorm", D, H, over="mdoel")
    with pytest.raises(ConfigError, match="cap must be > 0"):
        build_mechanism("softcap", D, H, cap=-1)
    with pytest.raises(ConfigError, match="max_len"):
        build_mechanism("qknorm", D, H, max_len=1)
    with pytest.raises(ConfigError, match="d_head"):
        build_mechanism("scaled", 0, H)
    for err in (ConfigError, ValueError):
        with pytest.raises(err):
            MultiHeadAttention(10, 3)
    assert mechanism_options("softcap") == ("cap",) and mechanism_options("scaled") == ()


# --- MultiHeadAttention -----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_multi_head_attention_shapes(name):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, name)
    x, ctx = torch.randn(3, 5, 16), torch.randn(3, 9, 16)
    assert mha(x, causal=True).shape == (3, 5, 16)
    if MECHANISMS[name].logit_bias == "forget":  # FoX is causal self-attention
        for call in (lambda: mha(x), lambda: mha(x, ctx, causal=True)):
            with pytest.raises(ConfigError, match="causal self-attention"):
                call()
        return
    assert mha(x).shape == (3, 5, 16)
    assert mha(x, ctx).shape == (3, 5, 16)
    width = 18 if MECHANISMS[name].normaliser == "differential" else 9  # two maps side by side
    assert mha.logits(x, ctx).shape == (3, 2, 5, width)


def test_init_reparam_logits_equal_scaled_at_step_zero():
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    models = {}
    for name in ("scaled", "init-reparam"):
        torch.manual_seed(7)
        models[name] = MultiHeadAttention(32, 4, name, dtype=torch.float64)
    assert_close(models["init-reparam"].logits(x), models["scaled"].logits(x), rtol=1e-13,
                 atol=1e-13)
    assert_close(models["init-reparam"](x), models["scaled"](x), rtol=1e-13, atol=1e-13)
    gain = 8 ** -0.25  # d_head = 8
    assert_close(models["init-reparam"].w_q.weight, gain * models["scaled"].w_q.weight)
    assert_close(models["init-reparam"].w_v.weight, models["scaled"].w_v.weight)


def test_qk_layernorm_over_model_normalises_the_whole_projection():
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 3, "qk-layernorm", over="model", dtype=torch.float64)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    q = _layer_norm(mha.w_q(x), -1).view(2, 5, 3, 4).transpose(1, 2)  # LN before the head split
    k = _layer_norm(mha.w_k(x), -1).view(2, 5, 3, 4).transpose(1, 2)
    assert_close(mha.logits(x), _dot(q, k) / 2.0)


def test_sigma_reparam_starts_at_w0_and_tracks_the_spectral_norm():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, "sigma-reparam", dtype=torch.float64)
    w0 = mha.w_q.parametrizations.weight.original
    sigma = torch.linalg.matrix_norm(w0.detach(), ord=2)
    param = mha.w_q.parametrizations.weight[0]
    assert isinstance(param, SigmaReparam)
    assert_close(param.gamma.detach(), sigma, rtol=1e-2, atol=0)  # γ init ~ σ(W_0)
    mha.eval()
    assert_close(mha.w_q.weight, w0, rtol=1e-13, atol=1e-15)       # Ŵ = W_0 at init
    # One power-iteration step per training forward, none in eval.
    u = param.u.clone()
    with torch.no_grad():
        w0.mul_(torch.linspace(0.5, 2.0, 16, dtype=torch.float64)[:, None])  # change W
    mha(torch.randn(1, 3, 16, dtype=torch.float64))
    assert torch.equal(param.u, u)
    mha.train()
    for _ in range(30):
        mha(torch.randn(1, 3, 16, dtype=torch.float64))
    assert not torch.equal(param.u, u)
    w = mha.w_q.weight.detach()
    assert_close(torch.linalg.matrix_norm(w, ord=2), param.gamma.detach(), rtol=1e-4, atol=0)
    # Gradients reach both W and γ, and two forwards before one backward are fine.
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    (mha(x).sum() + mha(x).sum()).backward()
    assert param.gamma.grad is not None and w0.grad is not None


# --- the mechanisms of 2024-2026: weights and outputs against float64 formulas ----------------


def _qkv(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for n in (NQ, NK, NK))


def _mask(seed=1):
    mask = torch.rand(NQ, NK, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[2] = False  # a query with no key to attend
    return mask


def test_sink_weights_equal_the_gpt_oss_formula_and_empty_rows_go_to_the_sink():
    m = build_mechanism("sink", D, H).double()
    with torch.no_grad():
        m.b.copy_(torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float64))
    q, k, v = _qkv()
    mask = _mask()
    z = (_dot(q, k) / math.sqrt(D)).masked_fill(~mask, -math.inf)
    e = torch.exp(z)
    p = e / (torch.exp(m.b).view(H, 1, 1) + e.sum(-1, keepdim=True))   # e^z / (e^b + Σ e^z)
    trace = attnscale_attention(q, k, v, m, mask=mask, trace=True)
    assert_close(trace.weights, p)
    assert_close(attnscale_attention(q, k, v, m, mask=mask), p @ v)     # the fast path (SDPA)
    # A query with every key masked: all mass on the sink, zero weights, zero output.
    assert torch.equal(trace.weights[:, :, 2], torch.zeros(B, H, NK, dtype=torch.float64))
    assert torch.equal(attnscale_attention(q, k, v, m, mask=mask)[:, :, 2],
                       torch.zeros(B, H, D, dtype=torch.float64))
    assert m.no_weight_decay() == {"b"} and m.b.requires_grad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sink_kernel_gradients_equal_the_materialised_sink(causal, dtype):
    """The CPU sink kernel (the flash op's log-sum-exp gives each row's sink share) against
    autograd through softmax([z, b_h]) in float64, for q, k, v and b, under a mask with a row
    that attends nothing and with causality."""
    from attnscale.kernels.sink import sink_attention
    gen = torch.Generator().manual_seed(9)
    q, k, v, g = (torch.randn(2, 3, 12, 8, generator=gen, dtype=dtype) for _ in range(4))
    b = torch.tensor([-1.0, 0.3, 2.5], dtype=dtype)
    mask = torch.rand(2, 1, 12, 12, generator=gen) > 0.3
    mask[0, 0, 4] = False                      # a query with no key: all mass on the sink
    mask[1, 0, 0, 0] = False                   # under causality, query 0 of batch 1 sees none
    ins = [t.clone().requires_grad_() for t in (q, k, v, b)]
    got = sink_attention(*ins[:3], 0.35, ins[3], 0.0, mask, causal)
    grads = torch.autograd.grad(got, ins, g)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, b)]
    seen = mask & (torch.ones(12, 12, dtype=torch.bool).tril() if causal else True)
    z = (0.35 * ref[0] @ ref[1].transpose(-1, -2)).masked_fill(~seen, -math.inf)
    col = ref[3].view(1, 3, 1, 1).expand(2, 3, 12, 1)
    p = torch.softmax(torch.cat([z, col], dim=-1), dim=-1)[..., :-1]
    want = p @ ref[2]
    want_grads = torch.autograd.grad(want, ref, g.double())
    tol = {} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    assert_close(got.double(), want.detach(), **tol)
    assert torch.equal(got[0, :, 4], torch.zeros_like(got[0, :, 4]))
    for a, w in zip(grads, want_grads):
        assert_close(a.double(), w, **tol)


def test_sink_without_learning_is_softmax_off_by_one():
    m = build_mechanism("sink", D, H, learned=False).double()
    assert not any(True for _ in m.parameters()) and m.no_weight_decay() == set()
    q, k, v = _qkv()
    z = _dot(q, k) / math.sqrt(D)
    softmax1 = torch.exp(z) / (1.0 + torch.exp(z).sum(-1, keepdim=True))   # Miller 2023
    assert_close(attnscale_attention(q, k, v, m, causal=False), softmax1 @ v)
    with pytest.raises(ConfigError, match="learned"):
        build_mechanism("sink", D, H, learned="yes")


def test_sigmoid_weights_use_minus_log_n_of_the_attended_keys_and_the_bias_option():
    q, k, v = _qkv()
    mask = _mask()
    n = mask.sum(-1, keepdim=True).clamp(min=1).double()
    s = _dot(q, k) / math.sqrt(D)
    p = torch.sigmoid(s - torch.log(n)).masked_fill(~mask, 0.0)
    m = build_mechanism("sigmoid", D, H).double()
    assert_close(attnscale_attention(q, k, v, m, mask=mask, trace=True).weights, p)
    assert_close(attnscale_attention(q, k, v, m, mask=mask), p @ v)    # the blockwise kernel
    causal = torch.ones(NQ, NK, dtype=torch.bool).tril()
    n_c = causal.sum(-1, keepdim=True).double()
    p_c = torch.sigmoid(s - torch.log(n_c)).masked_fill(~causal, 0.0)
    assert_close(attnscale_attention(q, k, v, m, causal=True), p_c @ v)
    fixed = build_mechanism("sigmoid", D, H, bias=-2.0).double()
    assert_close(attnscale_attention(q, k, v, fixed), torch.sigmoid(s - 2.0) @ v)


def test_logn_scales_beyond_the_training_length_only():
    m = build_mechanism("logn", D, H, train_len=3).double()
    q, k, v = _qkv()
    n = torch.arange(1, NQ + 1, dtype=torch.float64).clamp(max=NK).view(NQ, 1)  # causal counts
    factor = (torch.log(n) / math.log(3)).clamp(min=1.0)                  # max(1, log_3 n)
    z = (factor * _dot(q, k) / math.sqrt(D)).masked_fill(
        ~torch.ones(NQ, NK, dtype=torch.bool).tril(), -math.inf)
    assert_close(attnscale_attention(q, k, v, m, causal=True), torch.softmax(z, -1) @ v)
    assert factor[:3].eq(1.0).all() and factor[3] > 1.0
    with pytest.raises(ConfigError, match="train_len"):
        build_mechanism("logn", D, H, train_len=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sharp", [0.3, 5.0])   # β > 1 on most rows / on a few rows only
def test_adaptive_queries_node_equals_autograd_through_the_product(dtype, sharp):
    """The fused adapt stage (one autograd node, ∂L/∂β only where β has a slope) against
    q * (s * row_temperature(...)) differentiated by autograd, under causality and a mask."""
    m = build_mechanism("adaptive-temp", D, H).to(dtype)
    gen = torch.Generator().manual_seed(11)
    q, k = (torch.randn(2, H, 48, D, generator=gen, dtype=dtype) * sharp for _ in range(2))
    mask = torch.rand(48, 48, generator=gen) > 0.25
    mask[:, 0] = True
    g, g_k = (torch.randn(2, H, 48, D, generator=gen, dtype=dtype) for _ in range(2))
    s = 1 / math.sqrt(D)
    tol = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    # k's own gradient arrives fresh (a product), as an expanded tensor (a sum), or not at all:
    # the entropy's key gradient is added into the first in place, into a copy of the second
    for k_loss in (lambda k_out: (k_out * g_k).sum(), lambda k_out: k_out.sum(), None):
        results = []
        for fused in (True, False):
            qa, ka = (t.clone().requires_grad_() for t in (q, k))
            if fused:
                out, k_out = m.adapt_queries(qa, ka, s, mask, True)
            else:
                out, k_out = qa * (s * m.row_temperature(qa, ka, s, mask, True)), ka
            loss = (out * g).sum() + (0.0 if k_loss is None else k_loss(k_out))
            results.append((out, *torch.autograd.grad(loss, (qa, ka))))
        for a, b in zip(*results):
            assert_close(a, b, **tol)
    sloped, rows = int((m.row_temperature(q, k, s, mask, True) > 1).sum()), 2 * H * 48
    # the backward's block path, and its gathered path (at most 1/8 of the rows)
    assert sloped > rows // 2 if sharp < 1 else 0 < sloped <= rows // 8
    q[0, 1, 7, 3] = math.nan   # a NaN in one query: as through the product
    out, _ = m.adapt_queries(q, k, s, mask, True)
    assert_close(out, q * (s * m.row_temperature(q, k, s, mask, True)), equal_nan=True, **tol)
    assert bool(out[0, 1, 7, 3].isnan()) and bool(out[0, 0].isfinite().all())


@pytest.mark.parametrize("where", ["query", "key", "masked key"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_adaptive_attention_gradients_with_non_finite_inputs_as_through_the_product(where,
                                                                                     value):
    """The fused adapt stage skips the rows without an entropy gradient without checking q and
    k: with a NaN or inf in a query, a key or a key no query attends, every gradient of the
    whole attention is still the one autograd gives through q * (s * row_temperature(...))."""
    m = build_mechanism("adaptive-temp", D, H)
    gen = torch.Generator().manual_seed(5)
    q, k, v, g = (torch.randn(2, H, 40, D, generator=gen) * 2 for _ in range(4))
    mask = torch.ones(40, 40, dtype=torch.bool)
    mask[:, 9] = False                                 # key 9: attended by no query
    row = {"query": (0, 1, 3), "key": (1, 0, 20), "masked key": (1, 0, 9)}[where]
    (q if where == "query" else k)[row][5] = value
    results = []
    for fused in (True, False):
        mech = m if fused else _Unfused(m)
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        out = attnscale_attention(qa, ka, va, mech, mask=mask, causal=True)
        results.append((out, *torch.autograd.grad(out, (qa, ka, va), g)))
    for a, b in zip(*results):
        assert_close(a, b, equal_nan=True, rtol=1e-5, atol=1e-5)
    assert not bool(results[0][1].isfinite().all())    # something did become non-finite


class _Unfused(torch.nn.Module):
    """A mechanism without its fused adapt stage: the pipeline multiplies q by
    ``scale * row_temperature(...)``, differentiated by autograd."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        if name == "adapt_queries":
            raise AttributeError(name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def prepare(self, q, k, n_keys):
        return self.inner.prepare(q, k, n_keys)

    def row_temperature(self, *args):
        return self.inner.row_temperature(*args)


def test_adaptive_temperature_polynomial_order_and_gradients():
    from attnscale.mechanisms.adaptive_temp import beta
    # -0.037 is the coefficient of H^4 and -1.791 the constant: β(1.5) by hand.
    h = torch.tensor([0.4, 0.5, 1.5, 2.5], dtype=torch.float64)
    assert_close(beta(h), torch.tensor([1.0, 1.0, 1.8455625,
                                        -0.037 * 2.5**4 + 0.481 * 2.5**3 - 2.3 * 2.5**2
                                        + 4.917 * 2.5 - 1.791], dtype=torch.float64))
    m = build_mechanism("adaptive-temp", D, H).double()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, n, D, generator=gen, dtype=torch.float64).mul(0.3)
               .requires_grad_() for n in (NQ, 40, 40))  # near-uniform rows: H > 0.5, β > 1
    mask = torch.rand(NQ, 40, generator=gen) > 0.3
    s = _dot(q, k) / math.sqrt(D)
    masked = s.masked_fill(~mask, -math.inf)
    scaled = (_beta(_entropy(masked)) * s).masked_fill(~mask, -math.inf)  # gradients through β
    want = torch.softmax(scaled, -1) @ v
    got = attnscale_attention(q, k, v, m, mask=mask)
    assert_close(got, want)
    assert bool((_beta(_entropy(masked)) > 1).all())
    g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    g_got = torch.autograd.grad(got.square().sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        assert_close(a, b)


def test_gated_multiplies_the_head_outputs_before_w_o():
    for granularity, width in (("head", 1), ("element", 4)):
        torch.manual_seed(0)
        mha = MultiHeadAttention(12, 3, "gated", granularity=granularity, dtype=torch.float64)
        x = torch.randn(2, 5, 12, dtype=torch.float64)
        heads = lambda t: t.view(2, 5, 3, 4).transpose(1, 2)   # noqa: E731
        q, k, v = heads(mha.w_q(x)), heads(mha.w_k(x)), heads(mha.w_v(x))
        z = _dot(q, k) / 2.0
        z = z.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
        gate = torch.sigmoid(x @ mha.mechanism.w_g.weight.T).view(2, 5, 3, width).transpose(1, 2)
        o = gate * (torch.softmax(z, -1) @ v)                    # σ(x W_g) ∘ attention, per head
        assert_close(mha(x, causal=True), mha.w_o(o.transpose(1, 2).reshape(2, 5, 12)))
    with pytest.raises(ConfigError, match="granularity"):
        build_mechanism("gated", D, H, granularity="token")
    with pytest.raises(ConfigError, match="layer's input"):
        build_mechanism("gated", D, H).gate_values(torch.zeros(1, 2, D * H))


def test_clip_qkv_clamps_q_k_and_v():
    m = build_mechanism("clip-qkv", D, H, clip=0.5).double()
    q, k, v = (t * 3 for t in _qkv())
    c = lambda t: t.clamp(-0.5, 0.5)   # noqa: E731
    z = _dot(c(q), c(k)) / math.sqrt(D)
    assert_close(attnscale_attention(q, k, v, m), torch.softmax(z, -1) @ c(v))
    with pytest.raises(ConfigError, match="clip must be > 0"):
        build_mechanism("clip-qkv", D, H, clip=0)


@pytest.mark.parametrize("case", ["inside", "boundary", "outside", "nan"])
def test_clip_qkv_values_and_gradients_are_the_clamps_bit_for_bit(case):
    """A tensor already inside [-c, c] skips the clamp; values and gradients stay torch.clamp's
    exactly, at the boundary too, and NaN stays NaN."""
    from attnscale.mechanisms.clip_qkv import _clamped
    x = torch.randn(3, 4, 9, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    if case == "boundary":
        x[0, 0, 0, :2] = torch.tensor([-8.0, 8.0], dtype=torch.float64)
    elif case == "outside":
        x[1, 2, 3, 4] = 8.5
    elif case == "nan":
        x[2, 1, 0, 0] = math.nan
    g = torch.randn_like(x)
    got, want = (x.clone().requires_grad_() for _ in range(2))
    out_got, out_want = _clamped(got, 8.0), want.clamp(-8.0, 8.0)
    assert torch.equal(out_got.nan_to_num(7.0), out_want.nan_to_num(7.0))
    (grad_got,), (grad_want,) = (torch.autograd.grad(o, t, g)
                                 for o, t in ((out_got, got), (out_want, want)))
    assert torch.equal(grad_got.nan_to_num(7.0), grad_want.nan_to_num(7.0))
    assert (out_got is got) == (case in ("inside", "boundary"))


def test_yarn_mscale_all_dim_multiplies_the_softmax_scale():
    q, k = _qk()
    s = _dot(q, k) / math.sqrt(D)
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0                          # yarn_get_mscale(40, a)
    got = build_mechanism("yarn", D, H, factor=40.0, mscale_all_dim=0.707).logits(q, k)
    assert_close(got, mscale**2 * s)
    assert_close(build_mechanism("yarn", D, H, factor=40.0, mscale_all_dim=0).logits(q, k), s)
    with pytest.raises(ConfigError, match="mscale_all_dim"):
        build_mechanism("yarn", D, H, mscale_all_dim=-1)


def test_mscale_is_deepseeks_softmax_scale():
    q, k = _qk()
    s = _dot(q, k) / math.sqrt(D)
    for factor, a in ((40.0, 1.0), (40.0, 0.707), (4.0, 2.0)):
        mscale = 0.1 * a * math.log(factor) + 1.0                    # yarn_get_mscale(factor, a)
        got = build_mechanism("mscale", D, H, factor=factor, mscale_all_dim=a).logits(q, k)
        assert_close(got, mscale**2 * s, rtol=1e-12, atol=1e-12)
    assert_close(build_mechanism("mscale", D, H, factor=40.0, mscale_all_dim=0).logits(q, k), s)
    assert_close(build_mechanism("mscale", D, H, factor=0.5).logits(q, k), s)  # no extension
    # DeepSeek-V3's default (mscale_all_dim 1) is YaRN's m² at the same factor.
    assert_close(build_mechanism("mscale", D, H, factor=8.0).logits(q, k),
                 build_mechanism("yarn", D, H, factor=8.0).logits(q, k))
    for bad in ({"mscale_all_dim": -1}, {"factor": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            build_mechanism("mscale", D, H, **bad)


def test_qk_rmsnorm_over_model_normalises_the_whole_projection():
    """OLMo 2's norm: one RMSNorm over all heads of q (and of k) before the head split, one gain
    per coordinate of the projection; the values and gradients of the gains and of x."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 3, "qk-rmsnorm", over="model", dtype=torch.float64)
    with torch.no_grad():
        for gain in (mha.mechanism.q_gain, mha.mechanism.k_gain):
            gain.add_(0.3 * torch.randn_like(gain))
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)

    def rms(t, gain):                                     # t (B, N, H·d), gain (H, 1, d)
        t = t / (t.pow(2).mean(-1, keepdim=True) + RMS_EPS).sqrt()
        return (t.view(2, 5, 3, 4).transpose(1, 2) * gain)  # (B, H, N, d)

    m = mha.mechanism
    want = _dot(rms(mha.w_q(x), m.q_gain), rms(mha.w_k(x), m.k_gain)) / 2.0
    got = mha.logits(x)
    assert_close(got, want)
    g = torch.randn_like(got)
    params = (x, m.q_gain, m.k_gain)
    for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        assert_close(a, b)
    # Per head, it is the Gemma 3 / Qwen3 norm; with one head the two agree.
    q, k = _qk()
    assert build_mechanism("qk-rmsnorm", D, H).q_gain.shape == (D,)
    one = (build_mechanism("qk-rmsnorm", D, 1, over=o).double() for o in ("head", "model"))
    assert_close(*(m1.logits(q[:, :1], k[:, :1]) for m1 in one))
    with pytest.raises(ConfigError, match=r"over.*Did you mean: model\?"):
        build_mechanism("qk-rmsnorm", D, H, over="mdoel")


def _explicit_entropy(q, k, g, seen, scale=1.0):
    """H of softmax(scale q kᵀ) over the ``seen`` keys, and its q and k gradients for incoming
    ``g``, by autograd through H = lse - Σ p z (no log of a zero weight: autograd stays
    finite)."""
    qr, kr = (t.clone().requires_grad_() for t in (q, k))
    raw = scale * qr @ kr.transpose(-2, -1)
    z = raw.masked_fill(~seen, -math.inf)
    p = torch.softmax(z, -1)
    want = torch.logsumexp(z, -1, keepdim=True) - (p * raw.masked_fill(~seen, 0.0)).sum(
        -1, keepdim=True)
    return (want.detach(), *torch.autograd.grad(want, (qr, kr), g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_entropy_kernel_skips_rows_without_gradient_exactly(dtype):
    """The entropy pass (compiled row kernel for float32 on the CPU, its lse read from p_max)
    against autograd through the explicit entropy, with the incoming gradient zero on whole
    blocks of rows (skipped) and on single rows, under a mask and causality."""
    from attnscale.kernels.entropy import _RowEntropy
    gen = torch.Generator().manual_seed(5)
    b, h, n, d = 2, 3, 24, 8
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    q[:, :, ::5] *= 6.0  # some sharp rows beside near-uniform ones
    k = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    mask = torch.rand(n, n, generator=gen) > 0.2
    mask[:, 0] = True  # every query keeps key 0 (causality leaves row 0 only that key)
    g = torch.randn(b, h, n, 1, generator=gen, dtype=torch.float64)
    g[:, :, :12] = 0.0   # with 4-row blocks: whole blocks without gradient
    g[:, :, 17] = 0.0    # and one row inside a block that has some
    qa, ka = (t.to(dtype).requires_grad_() for t in (q, k))
    got = _RowEntropy.apply(qa, ka, mask, True, 4 * n, 1.0)  # blocks of 4 rows
    dq, dk = torch.autograd.grad(got, (qa, ka), g.to(dtype))
    want, dq_want, dk_want = _explicit_entropy(q, k, g, mask & torch.ones(n, n).tril().bool())
    tol = {} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    assert_close(got.double(), want, **tol)
    assert_close(dq.double(), dq_want, **tol)
    assert_close(dk.double(), dk_want, **tol)
    assert bool(dq[:, :, :12].eq(0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_shape", [(24, 24), (2, 1, 24, 24)])
def test_row_entropy_backward_scores_only_the_rows_with_gradient(dtype, mask_shape, monkeypatch):
    """A few rows with a gradient (adaptive-temp's β > 1 on a handful of rows): the backward
    gathers those rows alone, and matches autograd through the explicit entropy under a mask
    and causality."""
    from attnscale.kernels import entropy
    sparse = []
    real = entropy._sparse_backward
    monkeypatch.setattr(entropy, "_sparse_backward",
                        lambda *a: sparse.append(int(a[8].sum())) or real(*a))
    gen = torch.Generator().manual_seed(7)
    b, h, n, d = 2, 3, 24, 8
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    mask = torch.rand(*mask_shape, generator=gen) > 0.2
    mask[..., 0] = True
    g = torch.zeros(b, h, n, 1, dtype=torch.float64)
    g[0, 1, 5], g[0, 1, 20], g[1, 2, 3], g[1, 0, 23] = 0.7, -1.3, 2.0, 0.4   # 4 of 144 rows
    qa, ka = (t.to(dtype).requires_grad_() for t in (q, k))
    got = entropy._RowEntropy.apply(qa, ka, mask, True, 4 * n, 0.6)     # scale 0.6
    dq, dk = torch.autograd.grad(got, (qa, ka), g.to(dtype))
    assert sparse == [4]  # the 4 rows with a gradient, gathered
    _, dq_want, dk_want = _explicit_entropy(q, k, g, mask & torch.ones(n, n).tril().bool(), 0.6)
    tol = {} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    assert_close(dq.double(), dq_want, **tol)
    assert_close(dk.double(), dk_want, **tol)
    assert int(dq.ne(0).any(dim=-1).sum()) == 4


def _entropy_grads(q, k, g, block_rows=4, scale=1.0):
    from attnscale.kernels.entropy import _RowEntropy
    qa, ka = (t.clone().requires_grad_() for t in (q, k))
    h = _RowEntropy.apply(qa, ka, None, False, block_rows * k.shape[-2], scale)
    return torch.autograd.grad(h, (qa, ka), g)


def test_row_entropy_backward_skips_exactly_the_blocks_without_gradient(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 2, 24, 8, generator=gen) for _ in range(2))
    g = torch.randn(1, 2, 24, 1, generator=gen)
    calls = []
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    from attnscale.kernels.entropy import _RowEntropy
    with torch.no_grad():
        _RowEntropy.apply(q, k, None, False, 4 * 24, 1.0)
    forward = len(calls)
    calls.clear()
    _entropy_grads(q, k, g)
    backward = len(calls) - forward
    calls.clear()
    g[:, :, :12] = 0.0   # the first 3 of 6 blocks of 4 rows get no gradient
    dq, _ = _entropy_grads(q, k, g)
    assert forward > 0 and backward > 0
    assert len(calls) - forward == backward // 2  # half the blocks skipped, not recomputed
    assert bool(dq[:, :, :12].eq(0).all()) and bool(dq[:, :, 12:].ne(0).any())


def test_row_entropy_backward_with_no_gradient_gives_zeros_and_keeps_nan():
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(2))
    dq, dk = _entropy_grads(q, k, torch.zeros(1, 2, 16, 1))
    assert_close(dq, torch.zeros_like(q)) and assert_close(dk, torch.zeros_like(k))
    # A NaN query row: 0 · ∂H/∂z is NaN, as autograd through the explicit entropy gives it,
    # whether or not the rest of the gradient is zero.
    q[0, 1, 3] = math.nan
    for g in (torch.zeros(1, 2, 16, 1), torch.ones(1, 2, 16, 1)):
        dq, dk = _entropy_grads(q, k, g)
        assert bool(dk[0, 1].isnan().any()) and bool(dq[0, 1, 3].isnan().all())
        assert bool(dk[0, 0].isfinite().all())
