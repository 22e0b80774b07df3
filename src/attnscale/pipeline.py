"""The attention pipeline: the one place where q, k and v become an output, and its observers.

The stages always run in this order, and only :func:`run` spells them out::

    q, k, scale = mechanism.prepare(q, k, n_keys)   # mechanism: normalise or clamp q, k; temperature
    scale = scale * mechanism.row_temperature(...)  # adapt: per-row factor (adaptive-temp only)
    v = mechanism.prepare_values(v)                 # values (clip-qkv's clamp only)
    z = scale * (q @ k.T) + mechanism.offset(n)     # logits (offset: sigmoid attention's bias)
    z = cap * tanh(z / cap)                         # cap, only for mechanisms with one (softcap)
    z = z + bias + mechanism_bias                   # logit bias: the caller's (position bias)
                                                    #   and the mechanism's (forgetting, selective)
    z = z.masked_fill(~mask, -inf)                  # mask
    p = normalise(z)                                # normaliser: softmax | sink | sigmoid |
                                                    #   softpick | stick-breaking |
                                                    #   differential (p1 − λ p2)
    o = p @ v
    o = mechanism.normalise_output(o)               # output norm (differential)
    o = o * gate                                    # output gate (gated, given the layer input)

A *mechanism* is anything with the :class:`Rule` attributes: ``prepare(q, k, n_keys) -> (q', k',
scale)``, a ``cap`` (float or None) and a ``normaliser``; a registry
:class:`~attnscale.mechanisms.Mechanism`, or HF's native temperature.  It contributes only that
rule.  :func:`attnscale.attention.attention` is the public entry point (it also accepts a registry
name); mechanisms called as modules come here directly.  This module imports no mechanism, so
:mod:`attnscale.mechanisms` can import it without a cycle.

The normalisers (:func:`normalise`), over the keys a query attends:

* ``"softmax"``: p_i = e^{z_i} / Σ_j e^{z_j};
* ``"sink"``: p_i = e^{z_i} / (e^{b_h} + Σ_j e^{z_j}) with the mechanism's per-head sink logit b_h,
  a key that carries no value (gpt-oss; softmax-off-by-one for b = 0).  A query with no key to
  attend puts all its mass on the sink: zero weights, zero output;
* ``"sigmoid"``: p_i = σ(z_i), elementwise; rows need not sum to 1 (Ramapuram et al. 2024);
* ``"softpick"``: p_i = ReLU(e^{z_i} - 1) / (Σ_j |e^{z_j} - 1| + ε), the rectified softmax (Zuhri
  et al. 2025): rows need not sum to 1 and weights can be exactly 0;
* ``"stick-breaking"``: p_j = β_j Π_{k > j} (1 - β_k), β = σ(z), over the keys in order, the
  nearest (largest index) last (Tan et al. 2024): under causality the keys up to the query,
  without it every key, the query taken to follow them all;
* ``"differential"``: p = softmax(z1) − λ softmax(z2), two logit maps from the two halves of each
  head's q and k (Ye et al. 2024), written side by side as z = [z1 | z2] (..., 2 Nk); the weights
  can be negative and sum to 1 − λ.

The logit bias is one stage, added after the cap and before the mask, with two sources that add:

* the caller's ``bias`` (float, broadcastable to (B, H, Nq, Nk)): a position bias (T5's relative
  bias, arXiv 1910.10683; ALiBi, arXiv 2108.12409) or the values of an additive mask, given to
  :func:`run`;
* the mechanism's own (its ``logit_bias``, computed here by :func:`mechanism_bias` from the
  prepared q and k or the model's gates), one of

  - ``"forget"``: c_i − c_j, c the cumulative sum of FoX's log forget gates ``log_forget``
    (B, H, max(Nq, Nk)), read from the layer input by the model (Lin et al. 2025); causal
    only.  Without ``log_forget`` (a bare module, a model that gives none) there is no bias;
  - ``"select"``: −F_ij = −Σ_{j<k<i} max(0, z⁰_kj), the first head's accumulated selection
    (Leviathan et al. 2024), computed from q and k.

By default the output is computed without materialising the (Nq, Nk) logits of every head: a scale
on (normalised) q and k is folded into q and runs on ``torch.nn.functional.
scaled_dot_product_attention``; a sink is one extra key on the same call, or on the CPU the
flash kernel's per-row log-sum-exp (:mod:`attnscale.kernels.sink`); a capped mechanism runs on
:func:`attnscale.kernels.softcap.capped_attention` and sigmoid attention on
:func:`attnscale.kernels.sigmoid.sigmoid_attention`, blockwise kernels whose extra memory is
O(Nk · block), as is the one kernel of softpick and stick-breaking, which normalise whole rows
(:mod:`attnscale.kernels.rowwise`); adaptive-temp's row entropies come from one blockwise pass
(:mod:`attnscale.kernels.entropy`) before SDPA; FoX's bias folds into SDPA as extra q/k channels
(:mod:`attnscale.kernels.forgetting`; FlexAttention on CUDA), selective attention runs on a
blockwise kernel (:mod:`attnscale.kernels.biased`) and differential attention's two maps on one
SDPA call with 2H heads (:mod:`attnscale.kernels.differential`).  A mechanism with
``adapt_queries(q, k, scale, mask, causal)`` folds its per-row factor into q itself and returns ``(q', k')`` (adaptive-temp:
one autograd node for the entropy, β and the product, k passing through it so that the entropy's
key gradient joins the attention's in place), the adapt stage's fast form; the factor and the
gradients are those of ``scale * row_temperature(...)``.  ``trace=True`` runs the same steps materialised
and returns every intermediate as an :class:`AttentionTrace`.

With the caller's ``bias``, softmax attention without a cap or a bias of its own runs on SDPA
with the bias as its float mask; every other rule (a cap, another normaliser, a mechanism's
bias) runs materialised (the caller's bias is O(Nq · Nk) already).  Under the differential
normaliser the caller's bias enters both maps, as an additive mask does in DiffLlama.  Selective
attention's selection is taken from q and k alone (the first head's scaled logits), without the
caller's bias.  Observers receive the caller's bias and the mask as one additive float ``mask``
(0/-inf where there is no bias), which the monitor and the guard read as such, and the bias
itself as ``Observation.bias``; the mechanism's bias comes as ``Observation.mechanism_bias``.

Masks are boolean, True meaning "attend", broadcastable to (B, H, Nq, Nk).  ``causal=True`` lets
query i attend keys j <= i (top-left aligned, as SDPA's ``is_causal``).  A query row with no key to
attend gives zero output and zero gradients, never NaN.  A NaN in q, k or v reaches exactly the
outputs that depend on it, on every path (the rule and what SDPA does instead:
:mod:`attnscale.kernels.nans`).  fp16 and bf16 inputs are computed with
float32 accumulation (:func:`attnscale.precision.upcast`) and returned in their own dtype.

Observers
---------
An observer is a callable that receives one :class:`Observation` per pipeline call: what the
pipeline computed before the softmax (the mechanism-prepared q and k, scale, cap, mask, causality
and key counts).  Register it with :func:`observe` (a context manager) or :func:`add_observer` (a
handle to ``remove()`` in a ``finally``, like ``torch.nn.Module`` hooks)::

    from attnscale.attention import observe   # the package's ``attnscale.attention`` is the function

    with observe(lambda obs: print(obs.q.shape, obs.scale)):
        model(x)

The contract:

* Observers are context-local (a :mod:`contextvars` stack): registering one affects the current
  thread (or asyncio task) only, and nothing global is replaced; ``attnscale.attention.attention``
  stays the same object.
* They are called in registration order, before the output is computed, with the pipeline's own
  tensors: they must not modify them in place (the output would change) and should read them
  under ``torch.no_grad()`` from ``.detach()`` views.  An exception from an observer propagates.
* The :class:`Observation` field names are stable; fields may be added, never renamed.
* :func:`running` is True while a pipeline call computes its output, so a tap on a lower-level
  kernel (SDPA) can tell attnscale's own calls from a foreign model's.
* Row statistics from the kernel that forms the logits.  Where the computation forms every
  logit anyway -- the blockwise soft-cap kernel (:func:`attnscale.kernels.softcap.forms_logits`)
  and the materialised ``trace=True`` path -- ``Observation.offers_rows`` is True and an observer
  may call ``observation.request_rows(sink)`` instead of scoring q kᵀ itself: after the output is
  computed, ``sink(rows)`` receives :func:`attnscale.stats.row_stats` of every query's masked
  logits, float64 (B, H, Nq, len(ROW_STATS_COLUMNS)), taken from the computation's own logit blocks, with ``count``
  0 for queries that have no key to attend.  The statistics equal a recomputation from
  ``q``, ``k``, ``scale``, ``cap`` and the mask to float rounding, and the output does not change
  by a bit.  Where the computation never forms the logits (SDPA, FlexAttention on CUDA, tracing),
  ``offers_rows`` is False and ``request_rows`` returns False: the observer computes them.
  Plain softmax on the CPU (float32, no gradient wanted, no caller's bias) offers them too:
  when an observer requests them, the call runs on the blockwise kernel of
  :mod:`attnscale.kernels.softmax_rows` instead of SDPA, which forms the logits once for both,
  and its output then equals SDPA's to float32 rounding, not bit for bit.
  ``Observation.rows_exact`` says which: True where requesting the rows leaves the output as it
  is, False where it swaps SDPA for that kernel; an observer that must keep every bit of the
  output (``monitor(exact_outputs=True)``) requests rows only where it is True.
  A mechanism with a logit bias of its own always offers them (the pipeline scores its biased
  logits in one blockwise pass, :func:`attnscale.kernels.biased.bias_row_stats`, when asked), so
  its statistics include that bias; ``Observation.mechanism_bias`` describes it for observers
  of their own.  Row statistics cover every logit bias, the caller's and the mechanism's: they
  are of the logits the normaliser sees.  (QK-Clip's S_max, the logits W_Q and W_K make, is
  taken without either: :meth:`attnscale.measure.monitor.observer.Call.peak_logits`.)
  So does differential attention, whose rows are of its two maps under the ``"differential"``
  normaliser (:func:`attnscale.kernels.differential.differential_row_stats`).
  Unobserved calls pay nothing for this (one ``None`` check per kernel block).
* Logits formed outside the pipeline.  A model that forms a mechanism's logits itself (from a
  table of scores, say, as the recall study's stacked models do) hands them to
  :func:`observe_logits`: observers receive an Observation whose ``logits`` holds them (and whose
  ``q`` and ``k`` are None), and the mechanism's logit tracking (qk-clip's S_max) folds them in
  training mode, as :func:`run` does for its own calls.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from attnscale.errors import ConfigError
from attnscale.kernels import nans
from attnscale.kernels.biased import (Bias, ForgetBias, SelectBias, bias_row_stats,
                                      biased_attention, dense_bias, pruned)
from attnscale.kernels.differential import (differential_attention, differential_row_stats,
                                            split_maps)
from attnscale.kernels.forgetting import forget_attention
from attnscale.kernels.native import ROW_STATS_COLUMNS
from attnscale.kernels.sigmoid import sigmoid_attention
from attnscale.kernels.sink import sink_attention
from attnscale.kernels.softcap import capped_attention, forms_logits
from attnscale.kernels.softmax_rows import forms_rows, softmax_rows_attention
from attnscale.kernels.rowwise import softpick_attention, stick_breaking_attention
from attnscale.kernels.softpick import softpick_weights
from attnscale.kernels.stick_breaking import stick_breaking_weights
from attnscale.precision import upcast
from attnscale.stats import NORMALISERS, check_normaliser, row_stats

# Scale: a Python float (passed straight to SDPA), or a tensor broadcastable to (B, H, Nq, 1):
# one value per head (H, 1, 1), or per query row when it depends on the keys attended (ssmax).
Scale = float | Tensor
# An additive-mask entry at or below this marks a masked key: exp(z - 1e4) is exactly 0 in every
# float dtype for any sane logit z, and HF (finfo.min), PyTorch (-inf) and BERT-era code (-1e4)
# all use values at or below it.  Finite entries above it are biases that belong to the logits.
MASKED_BIAS = -1e4


class Rule(Protocol):
    """What the pipeline needs of a mechanism (:class:`attnscale.mechanisms.Mechanism` documents
    each attribute and method)."""

    cap: float | None
    normaliser: str     # one of NORMALISERS
    per_key: bool       # False: row_temperature adapts the scale per row
    has_offset: bool    # offset(n_keys) is added to the logits
    acts_on_values: bool  # prepare_values acts on v
    logit_bias: str | None  # None, "forget" or "select" (see the module doc)
    normalises_output: bool  # normalise_output acts on p @ v (differential)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        ...

    def row_temperature(self, q: Tensor, k: Tensor, scale: Scale, mask: Tensor | None,
                        causal: bool) -> Tensor:
        ...

    def offset(self, n_keys: int | Tensor) -> float | Tensor:
        ...

    def prepare_values(self, v: Tensor) -> Tensor:
        ...

    def sink_logits(self) -> Tensor:
        ...

    def lam(self) -> Tensor:
        ...

    def normalise_output(self, o: Tensor) -> Tensor:
        ...


# The logit biases a mechanism can declare (its ``logit_bias``), see the module doc.
LOGIT_BIASES = ("forget", "select")


@dataclass(frozen=True)
class AttentionTrace:
    """The intermediates of one materialised pipeline call (``trace=True``)."""
    logits: Tensor   # (B, H, Nq, Nk) after the mechanism, cap and bias, before the mask
    #                  (B, H, Nq, 2 Nk) = [z1 | z2] under the differential normaliser
    weights: Tensor  # (B, H, Nq, Nk) the normaliser's; rows with no key to attend are all zero
    out: Tensor      # (B, H, Nq, d_v) in the dtype of v


@dataclass(frozen=True)
class Observation:
    """What an observer receives from one pipeline call (see the module doc for the contract)."""
    q: Tensor | None          # (B, H, Nq, d) after mechanism.prepare, float32 for half inputs
    k: Tensor | None          # (B, H, Nk, d) after mechanism.prepare (None: see ``logits``)
    scale: Scale              # the logits are cap(scale · q kᵀ); tensor broadcast to (B,H,Nq,1)
    cap: float | None         # soft-cap c, or None
    mask: Tensor | None       # the caller's boolean mask (True = attend), without causality;
                              # with a bias, bias and mask as one additive float (-inf = masked)
    causal: bool              # top-left causal, on top of ``mask``
    n_keys: int | Tensor      # keys each query attends: int, or (..., Nq, 1) int64
    mechanism: Rule           # the mechanism that prepared q and k
    offers_rows: bool = False  # whether request_rows can hand over the kernel's row statistics
    offset: float | Tensor = 0.0  # added to the logits before the cap: float or (B|1,H|1,Nq|1,1)
    sink: Tensor | None = None    # per-head sink logit (H,) for the "sink" normaliser
    gate: Tensor | None = None    # the output gate (B, H, Nq, 1 or d_v), or None
    normaliser: str = "softmax"   # one of NORMALISERS: how the masked logits become weights
    logits: Tensor | None = None  # (B, H, Nq, Nk), masked at -inf: given by observe_logits
    bias: Tensor | None = None    # the caller's additive logit bias (already in ``mask``), or None
    mechanism_bias: Bias | None = None  # the mechanism's logit bias (forgetting, selective)
    lam: Tensor | None = None     # λ of the "differential" normaliser (0-d, shared by the heads)
    rows_exact: bool = True       # requesting rows leaves the output bit for bit (module doc)
    _sinks: list = field(default_factory=list, repr=False, compare=False)

    def request_rows(self, sink: RowSink) -> bool:
        """Have ``sink(rows)`` called with this call's row statistics (see the module doc), from
        the kernel that forms the logits; False, and nothing registered, where none does."""
        if not self.offers_rows:
            return False
        self._sinks.append(sink)
        return True


Observer = Callable[[Observation], None]
# Receives float64 (B, H, Nq, len(ROW_STATS_COLUMNS)) row statistics of one pipeline call.
RowSink = Callable[[Tensor], None]

_OBSERVERS: contextvars.ContextVar[tuple[Observer, ...]] = contextvars.ContextVar(
    "attnscale_observers", default=())
_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("attnscale_running",
                                                                default=False)


class ObserverHandle:
    """Returned by :func:`add_observer`; :meth:`remove` unregisters the observer (idempotent)."""

    def __init__(self, observer: Observer):
        self.observer = observer

    def remove(self) -> None:
        current = _OBSERVERS.get()
        if self.observer in current:
            _OBSERVERS.set(tuple(o for o in current if o is not self.observer))


def add_observer(observer: Observer) -> ObserverHandle:
    """Register ``observer`` in the current context; call ``handle.remove()`` in a ``finally``."""
    if not callable(observer):
        raise ConfigError(f"observer must be callable, got {type(observer).__name__}.")
    if observer in _OBSERVERS.get():
        raise ConfigError("observer is already registered.")
    _OBSERVERS.set(_OBSERVERS.get() + (observer,))
    return ObserverHandle(observer)


@contextmanager
def observe(observer: Observer) -> Iterator[Observer]:
    """``with observe(fn):`` calls ``fn`` on every pipeline call inside the block (this context)."""
    handle = add_observer(observer)
    try:
        yield observer
    finally:
        handle.remove()


def observers() -> tuple[Observer, ...]:
    """The observers registered in the current context, in call order."""
    return _OBSERVERS.get()


def observe_logits(logits: Tensor, mechanism: Rule, *, gate: Tensor | None = None) -> None:
    """Hand the logits of an attention formed outside :func:`run` to the observers (see the
    module doc): ``logits`` (B, H, Nq, Nk) after the whole mechanism, masked keys at -inf;
    ``gate`` the output gate (B, H, Nq, 1 or d_v), if any.  In training mode a mechanism that
    tracks its logits (``observe``: qk-clip's S_max) folds them in first.  Observers receive
    ``q = k = None``, the logits in ``Observation.logits`` and ``n_keys`` per row."""
    if logits.dim() != 4:
        raise ConfigError(f"logits must be (B, H, Nq, Nk), got shape {tuple(logits.shape)}.")
    track = getattr(mechanism, "observe", None)
    if track is not None and getattr(mechanism, "training", False):
        track(logits)
    watchers = _OBSERVERS.get()
    if not watchers:
        return
    z = logits.detach()
    normaliser = _declares(mechanism, "normaliser", "softmax")
    n_keys = (z > float("-inf")).sum(-1, keepdim=True)
    if normaliser == "differential":  # two maps side by side: the keys of one
        n_keys = (z[..., :z.shape[-1] // 2] > float("-inf")).sum(-1, keepdim=True)
    seen = Observation(None, None, 1.0, None, None, False, n_keys, mechanism, gate=gate,
                       normaliser=normaliser, logits=z,
                       sink=mechanism.sink_logits() if normaliser == "sink" else None,
                       lam=_lam(mechanism, normaliser))
    for observer in watchers:
        observer(seen)


def running() -> bool:
    """True while a pipeline call (in this context) computes its output."""
    return _RUNNING.get()


def check_qkv(q: Tensor, k: Tensor, v: Tensor, mechanism: Rule | None = None) -> None:
    """ConfigError unless q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, d_v) are tensors of one
    floating dtype that fit together, and fit ``mechanism`` when it states the ``n_heads`` and
    ``d_head`` it was built for (a registry mechanism's per-head parameters and 1/√d depend on
    them: a mismatch is a size error or, worse, a silently wrong temperature)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if not t.is_floating_point():
            raise ConfigError(f"{name} must be a floating-point tensor, got {t.dtype}; cast it, "
                              f"e.g. {name}.float().")
    if not q.dtype == k.dtype == v.dtype:
        raise ConfigError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and "
                          f"{v.dtype}.")
    if not q.device == k.device == v.device:
        raise ConfigError(f"q, k and v must be on one device, got {q.device}, {k.device} and "
                          f"{v.device}.")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ConfigError(f"q, k and v must be (B, H, N, d), got shapes {tuple(q.shape)}, "
                          f"{tuple(k.shape)}, {tuple(v.shape)}.")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ConfigError(f"q, k, v shapes do not fit together: {tuple(q.shape)}, "
                          f"{tuple(k.shape)}, {tuple(v.shape)}.")
    heads, d_head = getattr(mechanism, "n_heads", None), getattr(mechanism, "d_head", None)
    if heads is not None and d_head is not None and (q.shape[1], q.shape[-1]) != (heads, d_head):
        name = getattr(mechanism, "name", "") or type(mechanism).__name__
        raise ConfigError(f"mechanism {name!r} was built for n_heads={heads}, d_head={d_head}; "
                          f"q has {q.shape[1]} heads of size {q.shape[-1]}.")


def causal_counts(n_q: int, n_k: int, device: torch.device | str | None = None) -> Tensor:
    """Keys query i attends under top-left causality, min(i + 1, Nk): int64 (Nq, 1)."""
    return torch.arange(1, n_q + 1, device=device).clamp(max=n_k).unsqueeze(-1)


def key_mask(mask: Tensor | None, causal: bool, q: Tensor, k: Tensor) -> Tensor | None:
    """The user's mask and causality as one boolean mask (True = attend), or None for all keys."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise ConfigError(f"mask must be a boolean tensor (True = attend), got {got}.")
        _check_pairwise("mask", mask, q, n_q, n_k)
    if causal:
        tril = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()  # (Nq, Nk)
        mask = tril if mask is None else mask & tril
    return mask


def key_counts(mask: Tensor | None, causal: bool, q: Tensor, k: Tensor) -> int | Tensor:
    """Keys each query attends: Nk, or (..., Nq, 1) int64 under causality or a mask."""
    if mask is not None:
        return key_mask(mask, causal, q, k).sum(-1, keepdim=True)
    if causal:  # counted without an (Nq, Nk) mask
        return causal_counts(q.shape[-2], k.shape[-2], q.device)
    return k.shape[-2]


def temper(dots: Tensor, scale: Scale, cap: float | None, offset: float | Tensor = 0.0) -> Tensor:
    """Logits from plain dot products: ``scale · dots + offset``, then ``cap · tanh(· / cap)``
    if capped."""
    z = dots * scale
    if isinstance(offset, Tensor) or offset != 0.0:
        z = z + offset
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z


def logits(q: Tensor, k: Tensor, scale: Scale, cap: float | None,
           offset: float | Tensor = 0.0) -> Tensor:
    """Logits of prepared q (..., Nq, d) and k (..., Nk, d), before the mask: (..., Nq, Nk)."""
    return temper(q @ k.transpose(-2, -1), scale, cap, offset)


def rule_logits(q: Tensor, k: Tensor, scale: Scale, cap: float | None, offset: float | Tensor,
                normaliser: str, mechanism_bias: Bias | None = None,
                bias: Tensor | None = None) -> Tensor:
    """Every logit of prepared q (B, H, Nq, d) and k (B, H, Nk, d) under a mechanism's rule,
    before the mask: (B, H, Nq, Nk) with the logit bias added after the cap (the mechanism's
    ``mechanism_bias`` and the caller's ``bias``, broadcastable to (B, H, Nq, Nk)), or under the
    ``"differential"`` normaliser the two maps of q's and k's halves side by side, (B, H, Nq,
    2 Nk), the caller's bias in both."""
    if normaliser == "differential":
        (q1, q2), (k1, k2) = split_maps(q), split_maps(k)
        z1, z2 = logits(q1, k1, scale, cap, offset), logits(q2, k2, scale, cap, offset)
        if bias is not None:
            z1, z2 = z1 + bias.to(z1.dtype), z2 + bias.to(z2.dtype)
        return torch.cat([z1, z2], dim=-1)
    z = logits(q, k, scale, cap, offset)
    if mechanism_bias is not None:
        if isinstance(scale, Tensor):
            raise ConfigError("a mechanism's logit bias with a per-head or per-row scale is not "
                              "supported.")
        z = z + dense_bias(mechanism_bias, q, k, scale)
    if bias is not None:
        z = z + bias.to(z.dtype)
    return z


def mechanism_bias(mechanism: Rule, q: Tensor, k: Tensor, mask: Tensor | None, causal: bool,
                   log_forget: Tensor | None = None) -> Bias | None:
    """The mechanism's logit bias for q (B, H, Nq, ·), k (B, H, Nk, ·), or None: selective
    attention's (from the boolean ``mask`` of the keys each query attends, causality aside),
    FoX's from ``log_forget`` (B, H, max(Nq, Nk)), the log forget gates (None: no forgetting);
    its c = cumsum(log f) is float64, whose float32 halves keep c_i − c_j exact far down a
    sequence (:mod:`attnscale.kernels.forgetting`)."""
    kind = _declares(mechanism, "logit_bias", None)
    if kind is None:
        if log_forget is not None:
            name = getattr(mechanism, "name", "") or type(mechanism).__name__
            raise ConfigError(f"log_forget: mechanism {name!r} has no forget gate (only a "
                              "mechanism whose logit_bias is 'forget', such as 'forgetting').")
        return None
    if kind == "select":  # with selective attention's context pruning, where it is set
        return SelectBias(mask, mechanism.budget)
    if kind != "forget":
        raise ConfigError(f"logit_bias must be one of {', '.join(LOGIT_BIASES)} or None, got "
                          f"{kind!r}.")
    if log_forget is None:
        return None
    check_log_forget(log_forget, q, k, causal)
    # c in float64 (its float32 halves keep the precision of c_i − c_j far down the sequence)
    c = torch.cumsum(log_forget.to(torch.float64), dim=-1)                 # (B|1, H|1, N)
    return ForgetBias(c.expand(q.shape[0], q.shape[1], -1))


def check_log_forget(log_forget: Tensor, q: Tensor, k: Tensor, causal: bool) -> None:
    """ConfigError unless ``log_forget`` fits q, k: a floating (B|1, H|1, max(Nq, Nk)) tensor of
    log forget gates (<= 0, or NaN, which propagates) on q's device, under causality."""
    n = max(q.shape[-2], k.shape[-2])
    if not isinstance(log_forget, Tensor) or not log_forget.is_floating_point():
        got = log_forget.dtype if isinstance(log_forget, Tensor) else type(log_forget).__name__
        raise ConfigError(f"log_forget must be a floating-point tensor of log forget gates, got "
                          f"{got}.")
    if (log_forget.dim() != 3 or log_forget.shape[-1] != n
            or log_forget.shape[0] not in (1, q.shape[0])
            or log_forget.shape[1] not in (1, q.shape[1])):
        raise ConfigError(f"log_forget must be (B, H, max(Nq, Nk)) = ({q.shape[0]}, {q.shape[1]}, "
                          f"{n}), got {tuple(log_forget.shape)}.")
    if log_forget.device != q.device:
        raise ConfigError(f"log_forget is on {log_forget.device} but q is on {q.device}.")
    if not causal:
        raise ConfigError("log_forget: forgetting attention is causal (a forget gate acts on the "
                          "keys before a query); pass causal=True.")


def apply_rule(mechanism: Rule, q: Tensor, k: Tensor, n_keys: int | Tensor, mask: Tensor | None,
               causal: bool) -> tuple[Tensor, Tensor, Scale, float | Tensor]:
    """The mechanism's stages before the logits: ``(q', k', scale, offset)``.

    ``prepare``, then (for a mechanism that is not ``per_key``) its per-row temperature, read from
    the logits of the keys each query attends (``mask``, boolean or None, and ``causal``), then
    the additive offset.  q and k are already upcast.
    """
    qs, ks, scale = mechanism.prepare(q, k, n_keys)                        # mechanism
    if not _declares(mechanism, "per_key", True):                          # adapt
        fused = getattr(mechanism, "adapt_queries", None)
        if fused is not None and not isinstance(scale, Tensor):
            # the same factor, folded into q by the mechanism's one autograd node
            (qs, ks), scale = fused(qs, ks, scale, mask, causal), 1.0
        else:
            scale = scale * mechanism.row_temperature(qs, ks, scale, mask, causal)
    offset = mechanism.offset(n_keys) if _declares(mechanism, "has_offset", False) else 0.0
    if isinstance(offset, Tensor):  # in the logits' dtype (float32 for half inputs)
        offset = offset.to(device=qs.device, dtype=qs.dtype)
    return qs, ks, scale, offset


def _declares(mechanism: Rule, attribute: str, default):
    """A :class:`Rule` attribute; a rule that only has ``prepare`` and ``cap`` (a duck-typed
    rule of one's own) gets the plain pipeline's value: per key, no offset, softmax, v as is."""
    return getattr(mechanism, attribute, default)


# The normalisers whose weights are a function of each whole row (the materialised form), and
# their blockwise kernels (the fused form).
_ROW_WEIGHTS = {"softpick": softpick_weights, "stick-breaking": stick_breaking_weights}
_ROW_KERNELS = {"softpick": softpick_attention, "stick-breaking": stick_breaking_attention}


def normalise(z: Tensor, normaliser: str, sink: Tensor | None = None,
              lam: Tensor | None = None) -> Tensor:
    """Weights from masked logits z (B, H, Nq, Nk) (``-inf`` = masked) by ``normaliser``.

    ``sink``: the per-head sink logit (H,) for ``"sink"``; ``lam``: λ (0-d, or per head (H,))
    for ``"differential"``, whose z is the two maps side by side, (B, H, Nq, 2 Nk).  A row with
    every key masked gets all zero weights under every normaliser but ``"softmax"`` and
    ``"differential"`` (NaN there: the caller zeroes it).
    """
    if normaliser == "softmax":
        return torch.softmax(z, dim=-1)
    if normaliser == "differential":
        z1, z2 = split_maps(z)
        lam = lam.to(z.dtype)
        lam = lam.view(-1, 1, 1) if lam.dim() == 1 else lam
        return torch.softmax(z1, dim=-1) - lam * torch.softmax(z2, dim=-1)
    if normaliser == "sigmoid":
        return torch.sigmoid(z)
    if normaliser in _ROW_WEIGHTS:
        return _ROW_WEIGHTS[normaliser](z)
    if normaliser == "sink":
        b = sink.to(z.dtype).view(-1, 1, 1).expand(*z.shape[:-1], 1)       # (B, H, Nq, 1)
        return torch.softmax(torch.cat([z, b], dim=-1), dim=-1)[..., :-1]  # the sink is dropped
    raise ConfigError(f"normaliser must be one of {', '.join(NORMALISERS)}, got {normaliser!r}.")


def run(q: Tensor, k: Tensor, v: Tensor, mechanism: Rule, *, mask: Tensor | None = None,
        causal: bool = False, trace: bool = False, gate: Tensor | None = None,
        bias: Tensor | None = None,
        log_forget: Tensor | None = None) -> Tensor | AttentionTrace:
    """The pipeline: output (B, H, Nq, d_v), or with ``trace=True`` an :class:`AttentionTrace`.

    ``mechanism`` is built (see :func:`attnscale.attention.attention` for registry names).
    ``gate``: the output gate, broadcastable to (B, H, Nq, d_v) (a gating mechanism's
    ``gate_values`` of the layer input), multiplied into the output; None for no gate.
    ``bias``: the caller's additive logit bias, float, broadcastable to (B, H, Nq, Nk) (module
    doc); it adds to the mechanism's own.
    ``log_forget``: FoX's log forget gates (B, H, max(Nq, Nk)) (its ``forget_gates`` of the
    layer input), for a mechanism whose ``logit_bias`` is ``"forget"``; causal only.
    Autocast is off inside: half inputs already accumulate in float32 here, and autocast would
    recast the kernels' float32 internals (their blocks, the mechanisms' statistics) to half.
    """
    if torch.is_autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):
            return run(q, k, v, mechanism, mask=mask, causal=causal, trace=trace, gate=gate,
                       bias=bias, log_forget=log_forget)
    check_qkv(q, k, v, mechanism)
    causal_call = causal  # as called (FoX's forget gates need it), before it joins the mask
    if bias is not None:
        check_bias(bias, q, k)
        if causal:  # the bias path forms its mask (SDPA takes a float mask or is_causal)
            mask, causal = key_mask(mask, True, q, k), False
    full_mask = None if mask is None else key_mask(mask, causal, q, k)
    if full_mask is not None:
        n_keys = full_mask.sum(-1, keepdim=True)  # (..., Nq, 1)
    else:
        n_keys = key_counts(None, causal, q, k)
    qs, ks, scale, offset = apply_rule(mechanism, upcast(q), upcast(k), n_keys, full_mask,
                                       causal)                             # mechanism, adapt
    track = getattr(mechanism, "track_logits", None)  # qk-clip's S_max, over the attended keys
    if track is not None:
        track(qs, ks, scale, full_mask, causal and full_mask is None)
    if _declares(mechanism, "acts_on_values", False):
        v = mechanism.prepare_values(v)                                    # values
    cap, normaliser = mechanism.cap, _declares(mechanism, "normaliser", "softmax")
    check_normaliser(normaliser)
    sink = mechanism.sink_logits() if normaliser == "sink" else None
    own = mechanism_bias(mechanism, qs, ks, full_mask, causal_call, log_forget)
    how = _How(scale, cap, offset, normaliser, sink, bias, own, _lam(mechanism, normaliser))
    materialised = trace or _materialises(how)
    if torch.compiler.is_compiling():
        # Observers are Python state outside the graph: compiled and exported graphs are not
        # observed (the monitor documents this), and their contextvars would break the trace.
        out = _compute(q, k, v, qs, ks, how, full_mask, n_keys, causal, trace)
        return _gated(_finished(out, mechanism), gate)
    watchers = _OBSERVERS.get()
    rows = seen = None
    if watchers:
        kernel_rows = cap is not None and normaliser == "softmax" and forms_logits(qs)
        # SDPA forms no logits; on the CPU the blockwise softmax kernel can stand in for it
        swaps = not materialised and _softmax_rows(how) and forms_rows(qs, ks, v)
        seen = Observation(qs, ks, scale, cap, mask if bias is None else additive_mask(bias, mask),
                           causal, n_keys, mechanism,
                           offers_rows=(materialised or kernel_rows or own is not None
                                        or normaliser == "differential" or swaps), offset=offset,
                           sink=sink, gate=gate, normaliser=normaliser, bias=bias,
                           mechanism_bias=own, lam=how.lam, rows_exact=not swaps)
        for observer in watchers:
            observer(seen)
        if seen._sinks:  # filled by the computation below
            rows = torch.zeros(*qs.shape[:-1], len(ROW_STATS_COLUMNS), dtype=torch.float64)
    token = _RUNNING.set(True)
    try:
        out = _compute(q, k, v, qs, ks, how, full_mask, n_keys, causal, trace, rows)
    finally:
        _RUNNING.reset(token)
    if rows is not None and own is not None and not materialised:  # biased logits, scored once
        bias_row_stats(qs, ks, how.scale, own, full_mask, causal, rows, row_stats)
    if rows is not None and normaliser == "differential" and not materialised:  # both maps
        differential_row_stats(qs, ks, how.scale, how.lam, full_mask, causal, rows, row_stats)
    if rows is not None:
        if full_mask is not None:  # queries with no key attended everything: count 0 and
            # every statistic 0, as row_stats gives a row without keys
            rows.masked_fill_((n_keys == 0).to(rows.device), 0.0)
        for sink_fn in seen._sinks:
            sink_fn(rows)
    return _gated(_finished(out, mechanism), gate)


@dataclass(frozen=True)
class _How:
    """The mechanism's rule after ``prepare``: how the kernels turn q' k'ᵀ into weights."""
    scale: Scale
    cap: float | None
    offset: float | Tensor
    normaliser: str
    sink: Tensor | None
    bias: Tensor | None = None            # the caller's additive logit bias
    mechanism_bias: Bias | None = None    # the mechanism's (forgetting, selective)
    lam: Tensor | None = None             # λ of the differential normaliser


def _lam(mechanism: Rule, normaliser: str) -> Tensor | None:
    """λ of the differential normaliser (0-d), None under the others."""
    return mechanism.lam() if normaliser == "differential" else None


def _finished(out: Tensor | AttentionTrace, mechanism: Rule) -> Tensor | AttentionTrace:
    """The mechanism's output normalisation (differential's per-head RMSNorm), if it has one;
    computed in float32 for half types."""
    if not _declares(mechanism, "normalises_output", False):
        return out
    if isinstance(out, AttentionTrace):
        return AttentionTrace(out.logits, out.weights, _finished(out.out, mechanism))
    return mechanism.normalise_output(upcast(out)).to(out.dtype)


def check_bias(bias: Tensor, q: Tensor, k: Tensor) -> None:
    """ConfigError unless ``bias`` is a floating tensor on q's device broadcastable to
    (B, H, Nq, Nk)."""
    if not isinstance(bias, Tensor) or not bias.is_floating_point():
        got = bias.dtype if isinstance(bias, Tensor) else type(bias).__name__
        raise ConfigError(f"bias must be a floating tensor (an additive logit bias), got {got}.")
    _check_pairwise("bias", bias, q, q.shape[-2], k.shape[-2])


def _check_pairwise(name: str, t: Tensor, q: Tensor, n_q: int, n_k: int) -> None:
    """ConfigError unless the query-by-key tensor ``t`` (a mask or a bias) is on q's device and
    broadcasts to (B, H, Nq, Nk)."""
    if t.device != q.device:
        raise ConfigError(f"{name} is on {t.device} but q is on {q.device}.")
    full = (*q.shape[:2], n_q, n_k)
    try:
        fits = torch.broadcast_shapes(t.shape, full) == full
    except RuntimeError:
        fits = False
    if not fits:
        raise ConfigError(f"{name} of shape {tuple(t.shape)} does not broadcast to "
                          f"(B, H, Nq, Nk) = {full}.")


def additive_mask(bias: Tensor, mask: Tensor | None) -> Tensor:
    """``bias`` where ``mask`` (boolean, True = attend, or None) attends, -inf elsewhere."""
    return bias if mask is None else bias.masked_fill(~mask, float("-inf"))


def _softmax_rows(how: _How) -> bool:
    """Whether the call is plain softmax attention (no cap, no bias of either kind), which SDPA
    computes unobserved and :func:`softmax_rows_attention` when its row statistics are wanted."""
    return (how.cap is None and how.normaliser == "softmax" and how.bias is None
            and how.mechanism_bias is None)


def _materialises(how: _How) -> bool:
    """Whether the fused path runs materialised: a caller's bias on anything but uncapped
    softmax attention without a bias of its own (SDPA takes it as its float mask); the
    combinations are rare and the bias is O(Nq · Nk) already."""
    return how.bias is not None and (how.cap is not None or how.normaliser != "softmax"
                                     or how.mechanism_bias is not None)


def _gated(out: Tensor | AttentionTrace, gate: Tensor | None) -> Tensor | AttentionTrace:
    """The output gate: o · gate (float32 for half types), or ``out`` unchanged without one."""
    if gate is None:
        return out
    if isinstance(out, AttentionTrace):
        return AttentionTrace(out.logits, out.weights, _gated(out.out, gate))
    return (upcast(out) * gate.to(upcast(out).dtype)).to(out.dtype)


def _compute(q: Tensor, k: Tensor, v: Tensor, qs: Tensor, ks: Tensor, how: _How,
             full_mask: Tensor | None, n_keys: int | Tensor, causal: bool,
             trace: bool, rows: Tensor | None = None) -> Tensor | AttentionTrace:
    """The steps after ``prepare``: materialised (``trace``) or on the fused kernels; ``rows``
    (the observers' row statistics, see the module doc) is filled on the way when given."""
    if trace or _materialises(how):
        # A caller's bias beside a cap, another normaliser or a mechanism's own bias.
        if full_mask is None and causal:
            full_mask = key_mask(None, True, q, k)
        out = _materialised(qs, ks, v, how, full_mask, n_keys, rows)
        return out if trace else out.out
    # The blockwise softmax kernel hides masked keys itself, like the selective kernel
    exact_qk = isinstance(how.mechanism_bias, SelectBias) or (rows is not None
                                                               and _softmax_rows(how))
    if full_mask is None:
        # Causality alone never leaves a query without keys, and the kernels skip the keys
        # above the diagonal themselves (SDPA's is_causal).
        out = _fused(qs, ks, v, how, None, causal, rows)
        return _nan_ruled(out, qs, ks, v, how, None, causal, exact_qk)
    # Rows with no key would give NaN in softmax; let them attend everything, then zero them,
    # which also zeroes their gradients.  O(mask) work, only when a mask is given.
    empty = n_keys == 0  # (..., Nq, 1)
    out = _fused(qs, ks, v, how, full_mask | empty, False, rows)
    return _nan_ruled(out, qs, ks, v, how, full_mask, False, exact_qk).masked_fill(empty, 0.0)


def _nan_ruled(out: Tensor, q: Tensor, k: Tensor, v: Tensor, how: _How, mask: Tensor | None,
               causal: bool, exact_qk: bool) -> Tensor:
    """``out`` of :func:`_fused` with its NaN where the rule of :mod:`attnscale.kernels.nans`
    puts them (a cheap screen first; the exact path recomputes on the same kernels);
    ``exact_qk``: the kernel placed the NaN of q and k itself
    (:func:`attnscale.kernels.nans.ruled`)."""
    def recompute(q: Tensor, k: Tensor, v: Tensor, scale: Scale, offset: float | Tensor,
                  sink: Tensor | None, mask: Tensor | None) -> Tensor:
        return _fused(q, k, v, replace(how, scale=scale, offset=offset, sink=sink), mask, causal)
    # The CPU flash op serves softmax, the sink and differential attention's two maps; the
    # selective kernel places the NaN of q and k itself (its selection carries them on).
    return nans.ruled(out, q, k, v, how.scale, how.offset, how.sink, mask, causal, recompute,
                      flash=how.cap is None and how.normaliser in ("softmax", "sink",
                                                                   "differential"),
                      exact_qk=exact_qk)


def _materialised(q: Tensor, k: Tensor, v: Tensor, how: _How, mask: Tensor | None,
                  n_keys: int | Tensor, rows: Tensor | None = None) -> AttentionTrace:
    """The steps after ``prepare`` written out, O(B · H · Nq · Nk) memory."""
    z = rule_logits(q, k, how.scale, how.cap, how.offset, how.normaliser,
                    how.mechanism_bias, how.bias)                  # logits, cap, bias (B,H,Nq,Nk)
    masked = z
    if mask is not None:
        empty = n_keys == 0                                        # rows with nothing to attend
        keep = mask | empty
        if how.normaliser == "differential":  # both maps of a row see the same keys
            keep = torch.cat([keep.expand(*z.shape[:-1], -1)] * 2, dim=-1)
        masked = z.masked_fill(~keep, float("-inf"))               # mask
    own = how.mechanism_bias
    if isinstance(own, SelectBias) and own.budget is not None:     # context pruning
        f = -dense_bias(own, q, k, how.scale)                      # F, (B, 1, Nq, Nk)
        masked = masked.masked_fill(pruned(f, torch.isneginf(masked[:, :1]), own.budget),
                                    float("-inf"))
    if rows is not None:
        with torch.no_grad():
            rows.copy_(row_stats(masked.detach(), normaliser=how.normaliser, sink=how.sink,
                                 lam=None if how.lam is None else how.lam.detach()))
    p = normalise(masked, how.normaliser, how.sink, how.lam)       # normaliser
    if mask is not None:
        p = p.masked_fill(empty, 0.0)
    out = p @ upcast(v)                                            # (B, H, Nq, d_v)
    if mask is not None and not nans.recording(v) and nans.has_nan(out):
        # p · v carries a hidden key's NaN value on as 0 · NaN: the values' NaN reach only the
        # rows that attend them (the rule of attnscale.kernels.nans)
        hit = nans.reach(v.isnan(), mask, False, q.shape[-2])
        out = (p @ upcast(nans.without_nan(v))).masked_fill(hit, float("nan"))
    return AttentionTrace(logits=z, weights=p, out=out.to(v.dtype))


def _fused(q: Tensor, k: Tensor, v: Tensor, how: _How, mask: Tensor | None, causal: bool,
           rows: Tensor | None = None) -> Tensor:
    """The normalised weights times v on the fused kernels; q, k may be float32 for half v;
    ``rows`` only for the kernels that form the logits: the capped one, and for plain softmax
    the blockwise softmax kernel in SDPA's place (:func:`forms_rows` held)."""
    scale = how.scale
    if isinstance(scale, Tensor):  # per-head or per-row: folded into q, the kernels get a float
        q, scale = q * scale, 1.0
    if rows is not None and _softmax_rows(how):
        return softmax_rows_attention(q, k, v, scale, mask, causal, rows)
    own = how.mechanism_bias
    if (own is not None or how.normaliser == "differential") and (
            how.cap is not None or isinstance(how.offset, Tensor) or how.offset != 0.0):
        raise ConfigError("a mechanism's logit bias or the differential normaliser with a cap or "
                          "an offset is not supported.")
    # A caller's bias reaches this point only on uncapped softmax without a mechanism's bias
    # (_materialises): SDPA's float mask below.
    if how.normaliser == "differential":
        return differential_attention(q, k, v, scale, how.lam, mask, causal)
    if isinstance(own, ForgetBias):
        return forget_attention(q, k, v, scale, own, mask, causal)
    if own is not None:
        return biased_attention(q, k, v, scale, own, mask, causal)
    if how.normaliser == "sigmoid":
        return sigmoid_attention(q, k, v, scale, how.offset, how.cap, mask, causal)
    if how.normaliser in _ROW_KERNELS:
        return _ROW_KERNELS[how.normaliser](q, k, v, scale, how.offset, how.cap, mask, causal)
    # A per-row offset cancels in a softmax: only the sink sees it (relative to the sink logit).
    if how.normaliser == "sink":
        if how.cap is not None:
            raise ConfigError("a capped mechanism with a sink normaliser is not supported.")
        return sink_attention(q, k, v, scale, how.sink, how.offset, mask, causal)
    if how.cap is None:
        if how.bias is not None:  # SDPA adds a float mask to the scaled logits
            mask = additive_mask(how.bias.to(v.dtype), mask)
        # SDPA's CPU and CUDA kernels accumulate fp16/bf16 in float32 themselves.
        return F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask,
                                              is_causal=causal, scale=scale)
    return capped_attention(q, k, v, scale, how.cap, mask, causal, rows=rows, row_stats=row_stats)
