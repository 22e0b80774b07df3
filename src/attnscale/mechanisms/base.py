"""The :class:`Mechanism` base class and the registry it is entered into.

A mechanism owns the attention temperature.  It contributes its rule to the one attention
pipeline, :func:`attnscale.pipeline.run`, which applies the stages in its fixed order: ``prepare``
normalises (or clamps) q and k and picks the temperature, ``prepare_values`` may act on v, the
logits are ``scale · q' k'ᵀ + offset``, then ``cap · tanh(· / cap)`` when ``cap`` is set, a
``logit_bias`` where the mechanism has one, the mask, the ``normaliser`` (softmax, softmax with a
sink, an elementwise sigmoid, softpick, stick-breaking, or the difference of two softmax maps),
``@ v``, an output normalisation and an output ``gate`` where the mechanism has them.

A mechanism says what it is by attributes the pipeline and the experiments read; none of them is
found out by running it:

* ``normaliser``: ``"softmax"``, ``"sink"`` (softmax with one extra logit per head that carries no
  value, :meth:`Mechanism.sink_logits`), ``"sigmoid"`` (p_i = σ(z_i), rows need not sum to 1),
  ``"softpick"`` (the rectified softmax), ``"stick-breaking"`` (each key takes a share of what
  the nearer keys left) or ``"differential"`` (p1 − λ p2 of two softmax maps from the halves of
  q and k, :meth:`lam`); :func:`attnscale.pipeline.normalise` defines them;
* ``logit_bias``: a data-dependent bias on the logits, ``"forget"`` (FoX's decay, from the log
  forget gates :meth:`Mechanism.forget_gates` of the layer input, which only
  :class:`~attnscale.attention.MultiHeadAttention` and the LM can give) or ``"select"``
  (selective attention's, from q and k); None for most;
* ``normalises_output``: :meth:`Mechanism.normalise_output` acts on the output before the gate
  (differential attention's per-head RMSNorm);
* ``encodes_position``: the weights carry the order of the keys themselves (stick-breaking's
  recency, FoX's decay), so the LM gives the mechanism no RoPE;
* ``gate``: the output is multiplied by a gate computed from the layer input
  (:meth:`Mechanism.gate_values`), which needs the layer's input, so only
  :class:`~attnscale.attention.MultiHeadAttention` and the LM can run it;
* ``bilinear``: ``prepare`` returns q and k as given and a scale that depends on parameters and the
  key counts only, never on q or k, so the logits are ``cap(scale · q·k + offset)`` of the raw dot
  products;
* ``per_key``: each logit depends only on its own (q, k) pair and the key count (False for
  ``adaptive-temp``, whose temperature depends on the whole row);
* ``normalises_qk``: the logits are unchanged when q and k are scaled (qknorm, cosine, ...);
* ``scale_only`` is derived: the logits are ``scale · q' k'ᵀ`` with no offset, cap or bias and a
  plain softmax, which is exactly what ``scaled_dot_product_attention`` computes.
"""

from __future__ import annotations

import math
from typing import ClassVar

from torch import Tensor, nn

from attnscale import pipeline
from attnscale.errors import check_int
from attnscale.pipeline import Scale  # noqa: F401  (mechanism files import it from here)
from attnscale.precision import upcast

MECHANISMS: dict[str, type[Mechanism]] = {}


def register(name: str):
    """Class decorator that enters a :class:`Mechanism` into :data:`MECHANISMS` under ``name``.

    The key is the one name of the mechanism everywhere: CLI value, JSON field, legend and report.
    """
    def add(cls: type[Mechanism]) -> type[Mechanism]:
        if name in MECHANISMS:
            raise ValueError(f"mechanism {name!r} is already registered "
                             f"(by {MECHANISMS[name].__module__}.{MECHANISMS[name].__qualname__})")
        cls.name = name
        MECHANISMS[name] = cls
        return cls
    return add


def inv_sqrt(d_head: int) -> float:
    """The transformer's default temperature, 1/sqrt(d) (Vaswani et al. 2017)."""
    return 1.0 / math.sqrt(d_head)


class Mechanism(nn.Module):
    """Per-head attention logits, before the mask.

    Subclasses set the class attributes below and implement :meth:`prepare`; options are
    keyword-only arguments of ``__init__`` after ``d_head`` and ``n_heads`` (that signature is what
    :func:`attnscale.mechanisms.build_mechanism` validates options against).
    """

    name: ClassVar[str] = ""                # registry key, set by @register
    # The temperature is a rule on q and k known at init without data; False when it lives in
    # the weights of W_Q and W_K (init-reparam, sigma-reparam), so bare q, k cannot show it.
    defined_at_init: ClassVar[bool] = True
    # How the masked logits become weights: one of attnscale.stats.NORMALISERS ("softmax",
    # "sink", "sigmoid", "softpick", "stick-breaking", "differential"; the module doc).
    normaliser: ClassVar[str] = "softmax"
    # The output is gated by σ(x W_g) computed from the layer input (gate_values).
    gate: ClassVar[bool] = False
    # prepare hands q and k back untouched and its scale does not depend on q or k.
    bilinear: ClassVar[bool] = True
    # Each logit depends only on its (q, k) pair and the key count, not on the row's other keys.
    per_key: ClassVar[bool] = True
    # The logits do not change when q and k are scaled (a normalisation of q and k).
    normalises_qk: ClassVar[bool] = False
    # prepare_values acts on v (clip-qkv's clamp).
    acts_on_values: ClassVar[bool] = False
    # The rule is invariant under a joint rotation of q and k (dot products and norms only), so
    # Monte Carlo may sample q and k in a rotated frame (attnscale.measure.montecarlo); False for rules
    # that single out coordinates, such as LayerNorm's mean subtraction.
    rotation_invariant: ClassVar[bool] = True
    cap: float | None = None                # soft-cap c in c * tanh(z / c), applied after the scale
    # A data-dependent logit bias: "forget" (FoX, from the layer input) or "select" (selective).
    logit_bias: ClassVar[str | None] = None
    # normalise_output acts on the attention output (differential's per-head RMSNorm).
    normalises_output: ClassVar[bool] = False
    # The weights carry the keys' order themselves (stick-breaking's recency, FoX's decay):
    # models built on the mechanism use no RoPE.
    encodes_position: ClassVar[bool] = False

    def __init__(self, d_head: int, n_heads: int):
        super().__init__()
        self.d_head = check_int("d_head", d_head, minimum=1)
        self.n_heads = check_int("n_heads", n_heads, minimum=1)

    @property
    def scale_only(self) -> bool:
        """Whether the logits are ``scale · q' k'ᵀ`` (no offset, no cap) under a plain softmax:
        what the fused ``scaled_dot_product_attention`` kernel computes."""
        return (self.cap is None and self.normaliser == "softmax" and not self.has_offset
                and self.logit_bias is None)

    # An additive logit offset (sigmoid attention's bias b); False for most mechanisms.
    has_offset: ClassVar[bool] = False

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        """Return ``(q', k', scale)`` with logits ``scale * q' k'^T``.

        ``q`` is (B, H, Nq, d), ``k`` is (B, H, Nk, d).  ``n_keys`` is the number of keys each query
        attends: an int, or a tensor broadcastable to (B, H, Nq, 1) when a mask or causality makes
        it vary by row.  Only length-aware mechanisms (ssmax) read it.
        """
        raise NotImplementedError

    def offset(self, n_keys: int | Tensor) -> float | Tensor:
        """The additive logit offset, a float or a tensor broadcastable to (B, H, Nq, 1): 0 unless
        ``has_offset`` (sigmoid attention's b = -ln n)."""
        return 0.0

    def prepare_values(self, v: Tensor) -> Tensor:
        """v as the mechanism hands it to ``@ v``; unchanged unless ``acts_on_values``."""
        return v

    def row_temperature(self, q: Tensor, k: Tensor, scale: Scale, mask: Tensor | None,
                        causal: bool) -> Tensor:
        """A per-row factor on the scale, (B, H, Nq, 1), for mechanisms that are not ``per_key``
        (adaptive-temp): it may read the whole row's logits ``scale · q kᵀ`` under ``mask``."""
        raise NotImplementedError(f"{self.name or type(self).__name__} is per key")

    def sink_logits(self) -> Tensor:
        """The per-head sink logit b_h, (H,), for ``normaliser == "sink"``."""
        raise NotImplementedError(f"{self.name or type(self).__name__} has no sink")

    def gate_values(self, x: Tensor) -> Tensor:
        """σ(x W_g) for a gating mechanism: x (B, N, d_model) -> (B, H, N, 1 or d_head)."""
        raise NotImplementedError(f"{self.name or type(self).__name__} has no output gate")

    def forget_gates(self, x: Tensor) -> Tensor:
        """log f for a ``logit_bias == "forget"`` mechanism: x (B, N, d_model) -> (B, H, N)."""
        raise NotImplementedError(f"{self.name or type(self).__name__} has no forget gate")

    def lam(self) -> Tensor:
        """λ of the ``"differential"`` normaliser, a 0-d tensor."""
        raise NotImplementedError(f"{self.name or type(self).__name__} has no λ")

    def normalise_output(self, o: Tensor) -> Tensor:
        """The output (B, H, Nq, d_v) after the mechanism's normalisation
        (``normalises_output``)."""
        return o

    def at_depth(self, layer: int) -> None:
        """Told once, at build, by a model that stacks layers: this layer's depth l >= 1 (the
        first layer is 1).  Most mechanisms ignore it; differential's λ_init depends on it."""

    def logits(self, q: Tensor, k: Tensor, n_keys: int | Tensor | None = None, *,
               mask: Tensor | None = None, log_forget: Tensor | None = None) -> Tensor:
        """Logits after the mechanism (offset, cap and bias included), before the mask:
        (B, H, Nq, Nk); under the ``"differential"`` normaliser the two maps side by side,
        (B, H, Nq, 2 Nk).

        fp16/bf16 inputs give float32 logits.  ``n_keys`` defaults to the keys of ``mask`` (a
        boolean mask, True = attend, broadcastable to (B, H, Nq, Nk)), or to every key (Nk).  The
        mask itself is only read by a rule that is not ``per_key`` (adaptive-temp's row entropy
        covers the attended keys) and by selective attention's selection; the logits of masked
        keys are returned like the others.  ``log_forget``: a forgetting mechanism's log forget
        gates (B, H, max(Nq, Nk)), whose bias is causal (positions top-left aligned).
        """
        pipeline.check_qkv(q, k, k, self)  # shapes, dtypes and this mechanism's heads (k as v)
        q, k = upcast(q), upcast(k)
        if n_keys is None:
            n_keys = k.shape[-2] if mask is None else pipeline.key_counts(mask, False, q, k)
        full = None if mask is None else pipeline.key_mask(mask, False, q, k)
        q, k, scale, offset = pipeline.apply_rule(self, q, k, n_keys, full, False)
        own = pipeline.mechanism_bias(self, q, k, full, log_forget is not None, log_forget)
        return pipeline.rule_logits(q, k, scale, self.cap, offset, self.normaliser, own)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None,
                causal: bool = False) -> Tensor:
        """Attention output (B, H, Nq, d_v): the pipeline with this rule, as
        ``attnscale.attention(q, k, v, self, mask=mask, causal=causal)``."""
        return pipeline.run(q, k, v, self, mask=mask, causal=causal)

    def init_projections(self, w_q: nn.Linear, w_k: nn.Linear) -> None:
        """Act on a :class:`~attnscale.attention.MultiHeadAttention`'s W_Q and W_K once, at build.

        Most mechanisms leave them alone; init-reparam rescales them, sigma-reparam reparametrises.
        """

    def no_weight_decay(self) -> set[str]:
        """Names of this module's parameters that an optimiser should not decay."""
        return set()

    def extra_repr(self) -> str:
        return f"d_head={self.d_head}, n_heads={self.n_heads}"
