"""The :class:`Mechanism` base class and the registry it is entered into.

A mechanism owns the attention temperature.  It turns per-head queries and keys into logits in two
visible steps that :mod:`attnscale.attention` runs in a fixed order::

    q, k, scale = mechanism.prepare(q, k, n_keys)   # normalise q and k, pick the temperature
    z = scale * (q @ k.T)                           # logits
    z = cap * tanh(z / cap)                         # only when mechanism.cap is set (softcap)

Everything except the optional cap is a scale on (possibly normalised) q and k, which is why every
mechanism but ``softcap`` runs on the fused ``scaled_dot_product_attention`` kernel.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnscale.errors import check_int

# Scale: a Python float (passed straight to SDPA), or a tensor broadcastable to (B, H, Nq, 1):
# one value per head (H, 1, 1), or per query row when it depends on the keys attended (ssmax).
Scale = float | Tensor

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


def upcast(x: Tensor) -> Tensor:
    """fp16/bf16 -> float32 so products and reductions accumulate in float32; others unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


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
        q, k = upcast(q), upcast(k)
        q, k, scale = self.prepare(q, k, k.shape[-2] if n_keys is None else n_keys)
        z = (q @ k.transpose(-2, -1)) * scale  # (B, H, Nq, Nk)
        if self.cap is not None:
            z = self.cap * torch.tanh(z / self.cap)
        return z

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None,
                causal: bool = False) -> Tensor:
        """Attention output (B, H, Nq, d_v); see :func:`attnscale.attention.attention`."""
        # attention.py imports this module, so it is imported when first called rather than above.
        from attnscale.attention import attention
        return attention(q, k, v, self, mask=mask, causal=causal)

    def init_projections(self, w_q: nn.Linear, w_k: nn.Linear) -> None:
        """Act on a :class:`~attnscale.attention.MultiHeadAttention`'s W_Q and W_K once, at build.

        Most mechanisms leave them alone; init-reparam rescales them, sigma-reparam reparametrises.
        """

    def no_weight_decay(self) -> set[str]:
        """Names of this module's parameters that an optimiser should not decay."""
        return set()

    def extra_repr(self) -> str:
        return f"d_head={self.d_head}, n_heads={self.n_heads}"
