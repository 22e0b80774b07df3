"""The :class:`Mechanism` base class and the registry it is entered into.

A mechanism owns the attention temperature.  It contributes its rule -- a prepare step and an
optional cap -- to the one attention pipeline, :func:`attnscale.pipeline.run`, which applies them in
its fixed order: ``prepare`` normalises q and k and picks the temperature, the logits are
``scale · q' k'ᵀ``, then ``cap · tanh(· / cap)`` when ``cap`` is set.

Everything except the optional cap is a scale on (possibly normalised) q and k, which is why every
mechanism but ``softcap`` runs on the fused ``scaled_dot_product_attention`` kernel.
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
    scale_only: ClassVar[bool] = True       # logits = scale * q'k'^T: runs on the fused SDPA kernel
    # The rule is invariant under a joint rotation of q and k (dot products and norms only), so
    # Monte Carlo may sample q and k in a rotated frame (attnscale.measure.montecarlo); False for rules
    # that single out coordinates, such as LayerNorm's mean subtraction.
    rotation_invariant: ClassVar[bool] = True
    cap: float | None = None                # soft-cap c in c * tanh(z / c), applied after the scale

    def __init__(self, d_head: int, n_heads: int):
        super().__init__()
        self.d_head = check_int("d_head", d_head, minimum=1)
        self.n_heads = check_int("n_heads", n_heads, minimum=1)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        """Return ``(q', k', scale)`` with logits ``scale * q' k'^T``.

        ``q`` is (B, H, Nq, d), ``k`` is (B, H, Nk, d).  ``n_keys`` is the number of keys each query
        attends: an int, or a tensor broadcastable to (B, H, Nq, 1) when a mask or causality makes
        it vary by row.  Only length-aware mechanisms (ssmax) read it.
        """
        raise NotImplementedError

    def logits(self, q: Tensor, k: Tensor, n_keys: int | Tensor | None = None) -> Tensor:
        """Logits after the mechanism (and the cap), before the mask: (B, H, Nq, Nk).

        fp16/bf16 inputs give float32 logits.  ``n_keys`` defaults to every key (Nk).
        """
        pipeline.check_qkv(q, k, k, self)  # shapes, dtypes and this mechanism's heads (k as v)
        q, k = upcast(q), upcast(k)
        q, k, scale = self.prepare(q, k, k.shape[-2] if n_keys is None else n_keys)
        return pipeline.logits(q, k, scale, self.cap)  # (B, H, Nq, Nk)

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
