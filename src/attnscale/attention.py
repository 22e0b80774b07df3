"""Attention whose temperature is a registry mechanism: :func:`attention`, the public entry to the
one attention pipeline (:mod:`attnscale.pipeline`), and :class:`MultiHeadAttention`.

The pipeline's order (mechanism -> scale -> cap -> mask -> softmax -> @ v) is written once, in
:func:`attnscale.pipeline.run`; see there for masks, dtypes and the fused kernels.  Its observer
hook is re-exported here: :func:`observe`, :func:`add_observer`, :class:`Observation`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnscale.errors import ConfigError, check_int, did_you_mean
from attnscale.mechanisms import Mechanism, build_mechanism, check_mechanism, mechanism_options
from attnscale.pipeline import (  # noqa: F401  (re-exported: the names in __all__)
    AttentionTrace, Observation, add_observer, causal_counts, check_qkv, key_mask, observe,
    observers, run,
)
from attnscale.precision import HALF_TYPES, upcast
from attnscale.workers import check_device

__all__ = ["AttentionTrace", "MultiHeadAttention", "Observation", "add_observer", "attention",
           "attention_reference", "causal_counts", "key_mask", "observe", "observers"]


def _as_mechanism(mechanism: Mechanism | str, q: Tensor) -> Mechanism:
    """A mechanism instance; a registry name is built at its init values for q's heads."""
    if isinstance(mechanism, str):
        built = build_mechanism(mechanism, q.shape[-1], q.shape[1])
        return built.to(device=q.device, dtype=upcast(q).dtype)  # prepare() sees upcast q and k
    if not callable(getattr(mechanism, "prepare", None)):
        raise ConfigError(f"mechanism must be a registry name or a built Mechanism, got "
                          f"{type(mechanism).__name__}.")
    return mechanism


def attention(q: Tensor, k: Tensor, v: Tensor, mechanism: Mechanism | str = "scaled", *,
              mask: Tensor | None = None, causal: bool = False, trace: bool = False,
              gate: Tensor | None = None, bias: Tensor | None = None,
              log_forget: Tensor | None = None) -> Tensor | AttentionTrace:
    """Attention output (B, H, Nq, d_v) for q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, d_v).

    ``mechanism`` is a built :class:`~attnscale.mechanisms.Mechanism` or a registry name (built at
    its init values).  ``mask`` is boolean (True = attend), broadcastable to (B, H, Nq, Nk);
    ``causal`` is top-left aligned.  With ``trace=True`` the same pipeline runs materialised and
    returns an :class:`AttentionTrace` (logits, weights, out), O(B · H · Nq · Nk) memory.
    ``gate`` (broadcastable to (B, H, Nq, d_v)) multiplies the output: a gating mechanism's
    ``gate_values`` of the layer input.  ``bias`` (float, broadcastable to (B, H, Nq, Nk)) is added
    to the logits after the cap, with the mask: a position bias (T5's relative bias, ALiBi); it
    adds to a mechanism's own logit bias.  ``log_forget`` (B, H, max(Nq, Nk)): a forgetting
    mechanism's log forget gates (its ``forget_gates`` of the layer input), causal only.
    """
    for name, flag in (("trace", trace), ("causal", causal)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, got {flag!r}.")
    check_qkv(q, k, v)  # before a registry name is built for q's dtype and heads
    return run(q, k, v, _as_mechanism(mechanism, q), mask=mask, causal=causal, trace=trace,
               gate=gate, bias=bias, log_forget=log_forget)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, mechanism: Mechanism | str = "scaled",
                        *, mask: Tensor | None = None, causal: bool = False,
                        log_forget: Tensor | None = None) -> AttentionTrace:
    """``attention(..., trace=True)``: logits, weights and output of every head, materialised."""
    return attention(q, k, v, mechanism, mask=mask, causal=causal, trace=True,
                     log_forget=log_forget)


class MultiHeadAttention(nn.Module):
    """Drop-in multi-head attention with its own W_Q, W_K, W_V, W_O and a registry mechanism.

    ``x`` (B, N, d_model) -> (B, N, d_model); ``context`` (B, Nk, d_model) gives cross-attention.
    ``options`` are the mechanism's own (``cap=30`` for softcap, ``over="model"`` for qk-layernorm).
    The projections use torch's standard ``nn.Linear`` init; the mechanism may then act on W_Q and
    W_K (init-reparam rescales them by d^(-1/4), sigma-reparam reparametrises them).

    Inputs are in the module's dtype, as for ``nn.Linear``: a float32 module fed bf16 or float64
    is a :class:`ConfigError` that says what to cast (``x.to(torch.float32)``, or the module
    ``.to(torch.bfloat16)``), never a silent change of precision.  Under ``torch.autocast`` the
    half and float32 dtypes mix as autocast decides.  Every head has its own K and V projection:
    grouped-query attention (``n_kv_heads``) is not offered here.
    """

    def __init__(self, d_model: int, n_heads: int, mechanism: str = "scaled", *,
                 bias: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, **options):
        super().__init__()
        d_model = check_int("d_model", d_model, minimum=1)
        n_heads = check_int("n_heads", n_heads, minimum=1)
        if d_model % n_heads:
            raise ConfigError(f"d_model must be divisible by n_heads, got {d_model} and {n_heads}.")
        if not isinstance(mechanism, str):  # a name here; built mechanisms go to attention()
            raise ConfigError(f"mechanism must be a registry name (str), got "
                              f"{type(mechanism).__name__}.")
        _check_options(mechanism, options)
        if not isinstance(bias, bool):
            clash = (f"; it is the projections' bias, not {mechanism!r}'s option of the same "
                     f"name, which MultiHeadAttention cannot pass on"
                     if "bias" in mechanism_options(mechanism) else "")
            raise ConfigError(f"bias must be True or False, got {bias!r}{clash}.")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"dtype must be a floating torch.dtype (torch.float32, "
                              f"torch.bfloat16...), got {dtype!r}.")
        if device is not None:
            device = check_device("device", device, meta=True)  # meta: a module for its shapes
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.w_q = nn.Linear(d_model, d_model, **factory)
        self.w_k = nn.Linear(d_model, d_model, **factory)
        self.w_v = nn.Linear(d_model, d_model, **factory)
        self.w_o = nn.Linear(d_model, d_model, **factory)
        self.mechanism = build_mechanism(mechanism, self.d_head, n_heads, **options)
        self.mechanism.to(device=device, dtype=dtype)
        # After the dtype is set, so init-reparam's rescale rounds in the model's own precision.
        self.mechanism.init_projections(self.w_q, self.w_k)

    def _check_input(self, x: Tensor, name: str) -> None:
        """ConfigError unless ``x`` is a (B, N, d_model) float tensor this module can take."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ConfigError(f"{name} must be a (B, N, d_model={self.d_model}) tensor, got "
                              f"{shape}.")
        dtype = self.w_q.weight.dtype
        if not x.is_floating_point():
            raise ConfigError(f"{name} must be floating point, got {x.dtype}; cast it with "
                              f"{name}.to({dtype}).")
        mixable = (torch.float32, *HALF_TYPES)  # the dtypes autocast reconciles
        if x.dtype != dtype and not (torch.is_autocast_enabled(x.device.type)
                                     and x.dtype in mixable and dtype in mixable):
            raise ConfigError(f"{name} is {x.dtype} but the module's weights are {dtype}: cast "
                              f"the input ({name}.to({dtype})) or the module "
                              f"(.to({x.dtype})).")

    def _split(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, N, d)

    def logits(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """Logits after the mechanism, before any mask: (B, H, N, Nk)."""
        kv = self._checked(x, context)
        return self.mechanism.logits(self._split(self.w_q(x)), self._split(self.w_k(kv)))

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                causal: bool = False) -> Tensor:
        kv = self._checked(x, context)
        q = self._split(self.w_q(x))   # (B, H, N, d)
        k = self._split(self.w_k(kv))  # (B, H, Nk, d)
        v = self._split(self.w_v(kv))  # (B, H, Nk, d)
        gate = self.mechanism.gate_values(x) if self.mechanism.gate else None  # (B, H, N, 1|d)
        log_forget = self._forget_gates(x, context, causal)                      # (B, H, N)
        o = attention(q, k, v, self.mechanism, mask=mask, causal=causal, gate=gate,
                      log_forget=log_forget)                                      # (B, H, N, d)
        b, h, n, d = o.shape
        return self.w_o(o.transpose(1, 2).reshape(b, n, h * d))  # (B, N, d_model)

    def _forget_gates(self, x: Tensor, context: Tensor | None, causal: bool) -> Tensor | None:
        """A forgetting mechanism's log forget gates of the layer input, (B, H, N); None for
        other mechanisms.  FoX is causal self-attention: other calls are refused."""
        if self.mechanism.logit_bias != "forget":
            return None
        if context is not None or not causal:
            raise ConfigError(f"mechanism {self.mechanism.name!r} is causal self-attention (its "
                              "forget gates act on the tokens before a query): call it with "
                              "causal=True and no context.")
        return self.mechanism.forget_gates(x)

    def _checked(self, x: Tensor, context: Tensor | None) -> Tensor:
        """The keys' source (``context``, else ``x``), both checked by :meth:`_check_input`."""
        self._check_input(x, "x")
        if context is None:
            return x
        self._check_input(context, "context")
        if context.shape[0] != x.shape[0]:
            raise ConfigError(f"context has batch {context.shape[0]}, x has {x.shape[0]}.")
        return context

    def no_weight_decay(self) -> set[str]:
        """Parameter names (as in ``named_parameters``) to exclude from weight decay."""
        return {f"mechanism.{name}" for name in self.mechanism.no_weight_decay()}


# Keywords of other attention APIs that ask for grouped-query (or multi-query) attention.
_GQA_KEYWORDS = ("n_kv_heads", "num_key_value_heads", "kv_heads", "num_kv_heads")


def _check_options(mechanism: str, options: dict) -> None:
    """ConfigError for a keyword of :class:`MultiHeadAttention` that neither it nor the
    mechanism takes; a request for grouped-query attention says that it is not offered."""
    check_mechanism(mechanism, param="mechanism")
    allowed = mechanism_options(mechanism)
    for key in options:
        if key in _GQA_KEYWORDS:
            raise ConfigError(f"{key}: MultiHeadAttention does not support grouped-query "
                              "attention; every head has its own K and V (use attention() "
                              "with k and v repeated per query head).")
        if key not in allowed:
            takes = f"its options: {', '.join(allowed)}" if allowed else "it takes no options"
            raise ConfigError(f"MultiHeadAttention got an unknown keyword {key!r}."
                              f"{did_you_mean(key, (*allowed, 'bias', 'device', 'dtype'))} "
                              f"Keywords: d_model, n_heads, mechanism, bias, device, dtype, and "
                              f"the mechanism's own ({mechanism!r}: {takes}).")
