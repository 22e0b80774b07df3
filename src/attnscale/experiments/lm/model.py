"""``attnscale.lm``: a small causal decoder language model on attnscale's one attention pipeline.

Pre-norm blocks (LayerNorm -> attention -> residual, LayerNorm -> MLP -> residual), RoPE on q and
k, no biases, a 4x GELU MLP, and an output layer tied to the token embedding.  Attention goes
through :func:`attnscale.attention.attention` with a registry mechanism, so every mechanism works,
including the ones that act on the weights (init-reparam rescales W_Q and W_K at build,
sigma-reparam reparametrises them) through ``mechanism.init_projections``.

Where the mechanism acts
------------------------
::

    q, k = W_Q x, W_K x                # (B, H, N, d) projections, where init-/sigma-reparam act
    q, k = rope(q), rope(k)            # rotate each (even, odd) pair by position * frequency
    o = attention(q, k, v, mechanism, causal=True)
        # inside: q', k', scale = mechanism.prepare(q, k, n_keys); z = scale q'k'^T; (cap); softmax

The mechanism sees the *rotated* q and k, because its ``prepare`` runs inside the one pipeline,
after the model has placed the tokens.  Every temperature rule (a scale, a cap, an L2 or RMS norm)
commutes with the rotation, so for them the order does not matter: a rotation keeps norms and
dot products of pairs rotated together.  Two things do not commute: LayerNorm's mean subtraction
(qk-layernorm) and a learned per-coordinate gain (qk-rmsnorm, qk-layernorm), which here act on
rotated coordinates; OLMo 2 and Gemma normalise before RoPE instead.  At init (gain 1) only the
mean subtraction differs.  We keep the pipeline order so that the logits the monitor and the
study measure are exactly the ones the softmax receives.

RoPE's frequencies are an argument of :func:`rope_tables`, and :meth:`LM.set_rope` swaps them
(and the context length): the hook a length study uses for YaRN-scaled frequencies.  A mechanism
whose weights or logits carry the order of the keys themselves (``encodes_position``:
stick-breaking's recency, Tan et al. 2024; FoX's forget gates, Lin et al. 2025) gets q and k
without RoPE, as in their papers.  Each layer tells its mechanism its depth (``at_depth``:
differential attention's λ_init grows with it), and a forgetting mechanism's gates read the
block's input.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnscale.attention import attention
from attnscale.errors import ConfigError, check_int
from attnscale.mechanisms import MECHANISMS, build_mechanism, check_mechanism
from attnscale.rng import cell_seed

# Byte-level tokens: one per byte value.
VOCAB_SIZE = 256
# RoPE base θ in θ^(-2i/d) (Su et al. 2021, RoFormer).
ROPE_BASE = 10000.0
# MLP hidden width = MLP_RATIO * d_model (Vaswani et al. 2017; GPT-2).
MLP_RATIO = 4
# torch.nn.LayerNorm's default epsilon.
NORM_EPS = 1e-5


@dataclass(frozen=True)
class LMConfig:
    """The model's shape; :class:`attnscale.experiments.lm.train.LMRunConfig` holds one of these."""

    d_model: int = 64                  # residual width ("width" in the study)
    n_layers: int = 2                  # transformer blocks
    n_heads: int = 2                   # attention heads; d_head = d_model / n_heads
    max_seq_len: int = 128             # longest input the RoPE tables are built for
    mechanism: str = "scaled"          # registry key of the attention-temperature mechanism
    options: Mapping[str, Any] = field(default_factory=dict)  # the mechanism's own options

    def validated(self) -> LMConfig:
        """Return self after checking every field; bad values raise a one-line ConfigError."""
        for name in ("d_model", "n_layers", "n_heads", "max_seq_len"):
            check_int(name, getattr(self, name), minimum=1)
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model (width) must be divisible by n_heads, got "
                              f"{self.d_model} and {self.n_heads}.")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"d_head = d_model / n_heads must be even for RoPE, got "
                              f"{self.d_model // self.n_heads}.")
        check_lm_mechanism(self.mechanism, self.options)
        build_mechanism(self.mechanism, self.d_head, self.n_heads, **dict(self.options))
        return self

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


def check_lm_mechanism(name: str, options: Mapping[str, Any]) -> None:
    """A known mechanism with known option names, given every option it requires (a keyword-only
    argument without a default): a missing one is a ConfigError naming it, not a TypeError."""
    check_mechanism(name, options, param="mechanism")
    params = inspect.signature(MECHANISMS[name].__init__).parameters.values()
    required = [p.name for p in params
                if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty]
    missing = [p for p in required if p not in options]
    if missing:
        raise ConfigError(f"mechanism {name!r} needs option(s) {', '.join(missing)}: pass "
                          f"{', '.join(m + '=...' for m in missing)} (--option KEY=VALUE).")


def rope_frequencies(d_head: int, base: float = ROPE_BASE) -> Tensor:
    """RoPE's angular frequencies θ_i = base^(-2i/d), i < d/2: (d/2,), float64."""
    return base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)


def rope_tables(inv_freq: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """cos and sin of position * frequency for positions 0..n-1: each (n, d/2), float32.

    Any frequencies work (YaRN's interpolated ones included); computed in float64 first so long
    contexts keep their precision.
    """
    angle = torch.arange(n, dtype=torch.float64).unsqueeze(-1) * inv_freq.double()  # (n, d/2)
    return angle.cos().float(), angle.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (even, odd) coordinate pair of x (B, H, N, d) by its angle: (B, H, N, d)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]                  # (B, H, N, d/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)          # (N, d/2)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, N, d/2, 2)
    return out.flatten(-2)                               # (B, H, N, d), pairs interleaved back


def _init_linear(linear: nn.Linear) -> nn.Linear:
    """W ~ N(0, 1/fan_in): unit-variance outputs for unit-variance inputs (LeCun init), so q and k
    have unit-variance coordinates at init and the 1/sqrt(d) question is the essay's."""
    nn.init.normal_(linear.weight, std=linear.in_features ** -0.5)
    return linear


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE; the temperature is a registry mechanism."""

    def __init__(self, config: LMConfig, layer: int = 1):
        super().__init__()
        d, self.n_heads, self.d_head = config.d_model, config.n_heads, config.d_head
        self.w_q = _init_linear(nn.Linear(d, d, bias=False))
        self.w_k = _init_linear(nn.Linear(d, d, bias=False))
        self.w_v = _init_linear(nn.Linear(d, d, bias=False))
        self.w_o = _init_linear(nn.Linear(d, d, bias=False))
        self.mechanism = build_mechanism(config.mechanism, self.d_head, self.n_heads,
                                         **dict(config.options))
        # After W_Q and W_K have their init: init-reparam rescales it, sigma-reparam starts at it.
        self.mechanism.init_projections(self.w_q, self.w_k)
        self.mechanism.at_depth(layer)                             # this block's depth, 1-based
        # The mechanism encodes the keys' positions itself (stick-breaking, forgetting): no RoPE.
        self.uses_rope = not self.mechanism.encodes_position

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, n, d = x.shape                                          # (B, N, d_model)

        def heads(t: Tensor) -> Tensor:
            return t.view(b, n, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, N, d)

        q, k = heads(self.w_q(x)), heads(self.w_k(x))              # (B, H, N, d)
        if self.uses_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, H, N, d)
        v = heads(self.w_v(x))                                     # (B, H, N, d)
        gate = self.mechanism.gate_values(x) if self.mechanism.gate else None  # (B, H, N, 1|d)
        log_forget = (self.mechanism.forget_gates(x)                # (B, H, N), FoX
                      if self.mechanism.logit_bias == "forget" else None)
        # The one pipeline; its observers (the monitor) see this call.
        # Under autocast q, k, v are already bf16, and attention() accumulates half inputs in
        # float32 itself; autocast inside it would recast its kernels' internals, so it is off.
        autocast = torch.is_autocast_enabled(x.device.type)
        with torch.autocast(x.device.type, enabled=False) if autocast else nullcontext():
            o = attention(q, k, v, self.mechanism, causal=True, gate=gate,
                          log_forget=log_forget)                   # (B, H, N, d)
        return self.w_o(o.transpose(1, 2).reshape(b, n, d))       # (B, N, d_model)


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.up = _init_linear(nn.Linear(d_model, MLP_RATIO * d_model, bias=False))
        self.down = _init_linear(nn.Linear(MLP_RATIO * d_model, d_model, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))                       # (B, N, d_model)


class Block(nn.Module):
    """x + attn(LN(x)), then x + mlp(LN(x)): pre-norm (GPT-2, Xiong et al. 2020)."""

    def __init__(self, config: LMConfig, layer: int = 1):
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model, eps=NORM_EPS, bias=False)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_mlp = nn.LayerNorm(config.d_model, eps=NORM_EPS, bias=False)
        self.mlp = MLP(config.d_model)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x), cos, sin)               # (B, N, d_model)
        return x + self.mlp(self.ln_mlp(x))                        # (B, N, d_model)


class LM(nn.Module):
    """Causal byte-level LM: tokens (B, N) int64 -> next-token logits (B, N, 256)."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config.validated()
        d = config.d_model
        self.embed = nn.Embedding(VOCAB_SIZE, d)
        # Tied with the output layer, so its init is the output layer's: N(0, 1/d_model) gives
        # logits of unit variance from the final LayerNorm, and a loss near ln 256 at init.
        nn.init.normal_(self.embed.weight, std=d ** -0.5)
        self.blocks = nn.ModuleList(Block(config, layer + 1) for layer in range(config.n_layers))
        self.ln_out = nn.LayerNorm(d, eps=NORM_EPS, bias=False)
        self.set_rope(rope_frequencies(config.d_head), config.max_seq_len)

    def set_rope(self, inv_freq: Tensor, max_seq_len: int) -> None:
        """Use RoPE frequencies ``inv_freq`` (d_head/2,) for contexts up to ``max_seq_len``.

        The model is built with :func:`rope_frequencies`; a length study passes YaRN's.
        """
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1)
        if inv_freq.shape != (self.config.d_head // 2,):
            raise ConfigError(f"inv_freq must have shape ({self.config.d_head // 2},), got "
                              f"{tuple(inv_freq.shape)}.")
        device = self.embed.weight.device
        cos, sin = rope_tables(inv_freq, max_seq_len)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)  # (max_seq_len, d/2)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.max_seq_len = max_seq_len

    def forward(self, tokens: Tensor) -> Tensor:
        n = tokens.shape[-1]
        if n > self.max_seq_len:
            raise ConfigError(f"sequence length {n} is above the model's max_seq_len "
                              f"{self.max_seq_len}.")
        cos, sin = self.rope_cos[:n], self.rope_sin[:n]            # (N, d/2)
        x = self.embed(tokens)                                     # (B, N, d_model)
        for block in self.blocks:
            x = block(x, cos, sin)                                 # (B, N, d_model)
        return F.linear(self.ln_out(x), self.embed.weight)         # (B, N, 256), tied

    def no_weight_decay(self) -> set[str]:
        """Parameter names not to decay: norm gains and the mechanisms' own (Swin V2 tau, ...)."""
        skip = {name for name, p in self.named_parameters() if p.dim() < 2}
        for i, block in enumerate(self.blocks):
            mech = block.attn.mechanism
            skip |= {f"blocks.{i}.attn.mechanism.{name}" for name in mech.no_weight_decay()}
        return skip


def build_lm(config: LMConfig, *, seed: int = 0, device: torch.device | str = "cpu") -> LM:
    """The model for ``config``, initialised from ``seed`` alone (the same weights on any device).

    Built on the CPU inside :func:`torch.random.fork_rng`, so mechanisms that draw from torch's
    global generator (sigma-reparam's power-iteration vectors) are seeded too, and the caller's
    generator is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cell_seed(seed, "lm-init"))
        model = LM(config)
    return model.to(device)
