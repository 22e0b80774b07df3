"""Attention whose temperature is a registry mechanism: one pipeline, a reference and fast paths.

The pre-softmax pipeline always runs in this order (:func:`attention_reference` spells it out)::

    q, k, scale = mechanism.prepare(q, k, n_keys)   # mechanism: normalise q, k; the temperature
    z = scale * (q @ k.T)                           # logits
    z = cap * tanh(z / cap)                         # cap, only for mechanisms with one (softcap)
    z = z.masked_fill(~mask, -inf)                  # mask
    p = softmax(z)                                  # softmax
    o = p @ v

:func:`attention` computes the same thing without materialising the (Nq, Nk) logits of every head:
a mechanism whose temperature is a scale on (normalised) q and k has the scale folded into q and
runs on ``torch.nn.functional.scaled_dot_product_attention``; a capped mechanism runs on
:func:`attnscale.kernels.softcap.capped_attention`, a blockwise kernel whose extra memory is O(Nk · block), not O(Nq · Nk).

Masks are boolean, True meaning "attend", broadcastable to (B, H, Nq, Nk).  ``causal=True`` lets
query i attend keys j <= i (top-left aligned, as SDPA's ``is_causal``).  A query row with no key to
attend gives zero output and zero gradients, never NaN.  fp16 and bf16 inputs are computed with
float32 accumulation and returned in their own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnscale.errors import ConfigError, check_int
from attnscale.mechanisms import Mechanism, build_mechanism
from attnscale.mechanisms.base import Scale, upcast
from attnscale.kernels.softcap import capped_attention



@dataclass(frozen=True)
class AttentionTrace:
    """The intermediates of :func:`attention_reference`, so they can be measured without hooks."""
    logits: Tensor   # (B, H, Nq, Nk) after the mechanism and the cap, before the mask
    weights: Tensor  # (B, H, Nq, Nk) softmax; rows with no key to attend are all zero
    out: Tensor      # (B, H, Nq, d_v) in the dtype of v


def _as_mechanism(mechanism: Mechanism | str, q: Tensor) -> Mechanism:
    """A mechanism instance; a registry name is built at its init values for q's heads."""
    if isinstance(mechanism, Mechanism):
        return mechanism
    built = build_mechanism(mechanism, q.shape[-1], q.shape[1])
    return built.to(device=q.device, dtype=upcast(q).dtype)  # prepare() sees upcast q and k


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ConfigError(f"q, k and v must be (B, H, N, d), got shapes {tuple(q.shape)}, "
                          f"{tuple(k.shape)}, {tuple(v.shape)}.")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ConfigError(f"q, k, v shapes do not fit together: {tuple(q.shape)}, "
                          f"{tuple(k.shape)}, {tuple(v.shape)}.")


def key_mask(mask: Tensor | None, causal: bool, q: Tensor, k: Tensor) -> Tensor | None:
    """The user's mask and causality as one boolean mask (True = attend), or None for all keys."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ConfigError(f"mask must be a boolean tensor (True = attend), got {mask.dtype}.")
        full = (*q.shape[:2], n_q, n_k)
        try:
            fits = torch.broadcast_shapes(mask.shape, full) == full
        except RuntimeError:
            fits = False
        if not fits:
            raise ConfigError(f"mask of shape {tuple(mask.shape)} does not broadcast to "
                              f"(B, H, Nq, Nk) = {full}.")
    if causal:
        tril = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()  # (Nq, Nk)
        mask = tril if mask is None else mask & tril
    return mask


def attention(q: Tensor, k: Tensor, v: Tensor, mechanism: Mechanism | str = "scaled", *,
              mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """Attention output (B, H, Nq, d_v) for q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, d_v).

    ``mechanism`` is a built :class:`~attnscale.mechanisms.Mechanism` or a registry name (built at
    its init values).  Numerically the same as :func:`attention_reference`, on fused kernels.
    """
    mechanism = _as_mechanism(mechanism, q)
    _check_qkv(q, k, v)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if mask is None:
        # No mask to build: causality alone never leaves a query without keys, and the kernels
        # skip the keys above the diagonal themselves (SDPA's is_causal).
        n_keys = _causal_counts(n_q, n_k, q.device) if causal else n_k
        qs, ks, scale = _fold(*mechanism.prepare(upcast(q), upcast(k), n_keys))
        return _attend(qs, ks, v, scale, mechanism.cap, None, causal)
    full_mask = key_mask(mask, causal, q, k)
    n_keys = full_mask.sum(-1, keepdim=True)  # (..., Nq, 1)
    qs, ks, scale = _fold(*mechanism.prepare(upcast(q), upcast(k), n_keys))
    # Rows with no key would give NaN in softmax; let them attend everything, then zero them,
    # which also zeroes their gradients.  O(mask) work, only when a mask is given.
    empty = n_keys == 0  # (..., Nq, 1)
    out = _attend(qs, ks, v, scale, mechanism.cap, full_mask | empty, False)
    return out.masked_fill(empty, 0.0)


def _causal_counts(n_q: int, n_k: int, device: torch.device) -> Tensor:
    """Keys query i attends under top-left causality, min(i + 1, Nk): (Nq, 1)."""
    return torch.arange(1, n_q + 1, device=device).clamp(max=n_k).unsqueeze(-1)


def _fold(q: Tensor, k: Tensor, scale: Scale) -> tuple[Tensor, Tensor, float]:
    """Fold a per-head or per-row temperature tensor into q, leaving SDPA a float scale."""
    if isinstance(scale, Tensor):
        return q * scale, k, 1.0
    return q, k, scale


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, cap: float | None,
            mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(cap(scale q kᵀ) masked) v on the fused kernels; q, k may be float32 for half v."""
    if cap is None:
        # SDPA's CPU and CUDA kernels accumulate fp16/bf16 in float32 themselves.
        return F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask,
                                              is_causal=causal, scale=scale)
    return capped_attention(q, k, v, scale, cap, mask, causal)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, mechanism: Mechanism | str = "scaled",
                        *, mask: Tensor | None = None, causal: bool = False) -> AttentionTrace:
    """The pipeline written out and materialised: logits, weights and output of every head.

    Same arguments as :func:`attention`; O(B · H · Nq · Nk) memory, for tests and measurements.
    """
    mechanism = _as_mechanism(mechanism, q)
    _check_qkv(q, k, v)
    full_mask = key_mask(mask, causal, q, k)
    n_keys = k.shape[-2] if full_mask is None else full_mask.sum(-1, keepdim=True)
    q, k, v_acc = upcast(q), upcast(k), upcast(v)
    qs, ks, scale = mechanism.prepare(q, k, n_keys)            # mechanism
    z = (qs @ ks.transpose(-2, -1)) * scale                    # logits, (B, H, Nq, Nk)
    if mechanism.cap is not None:
        z = mechanism.cap * torch.tanh(z / mechanism.cap)      # cap
    masked = z
    if full_mask is not None:
        empty = n_keys == 0                                    # rows with nothing to attend
        masked = z.masked_fill(~(full_mask | empty), float("-inf"))  # mask
    p = torch.softmax(masked, dim=-1)                          # softmax, (B, H, Nq, Nk)
    if full_mask is not None:
        p = p.masked_fill(empty, 0.0)
    out = p @ v_acc                                            # (B, H, Nq, d_v)
    return AttentionTrace(logits=z, weights=p, out=out.to(v.dtype))


class MultiHeadAttention(nn.Module):
    """Drop-in multi-head attention with its own W_Q, W_K, W_V, W_O and a registry mechanism.

    ``x`` (B, N, d_model) -> (B, N, d_model); ``context`` (B, Nk, d_model) gives cross-attention.
    ``options`` are the mechanism's own (``cap=30`` for softcap, ``over="model"`` for qk-layernorm).
    The projections use torch's standard ``nn.Linear`` init; the mechanism may then act on W_Q and
    W_K (init-reparam rescales them by d^(-1/4), sigma-reparam reparametrises them).
    """

    def __init__(self, d_model: int, n_heads: int, mechanism: str = "scaled", *,
                 bias: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, **options):
        super().__init__()
        d_model = check_int("d_model", d_model, minimum=1)
        n_heads = check_int("n_heads", n_heads, minimum=1)
        if d_model % n_heads:
            raise ConfigError(f"d_model must be divisible by n_heads, got {d_model} and {n_heads}.")
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.w_q = nn.Linear(d_model, d_model, **factory)
        self.w_k = nn.Linear(d_model, d_model, **factory)
        self.w_v = nn.Linear(d_model, d_model, **factory)
        self.w_o = nn.Linear(d_model, d_model, **factory)
        self.mechanism = build_mechanism(mechanism, self.d_head, n_heads, **options)
        self.mechanism.to(device=device, dtype=dtype)
        # After the dtype is set, so init-reparam's rescale rounds in the model's own precision.
        self.mechanism.init_projections(self.w_q, self.w_k)

    def _split(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, N, d)

    def logits(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """Logits after the mechanism, before any mask: (B, H, N, Nk)."""
        kv = x if context is None else context
        return self.mechanism.logits(self._split(self.w_q(x)), self._split(self.w_k(kv)))

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                causal: bool = False) -> Tensor:
        kv = x if context is None else context
        q = self._split(self.w_q(x))   # (B, H, N, d)
        k = self._split(self.w_k(kv))  # (B, H, Nk, d)
        v = self._split(self.w_v(kv))  # (B, H, Nk, d)
        o = self.mechanism(q, k, v, mask=mask, causal=causal)  # (B, H, N, d)
        b, h, n, d = o.shape
        return self.w_o(o.transpose(1, 2).reshape(b, n, h * d))  # (B, N, d_model)

    def no_weight_decay(self) -> set[str]:
        """Parameter names (as in ``named_parameters``) to exclude from weight decay."""
        return {f"mechanism.{name}" for name in self.mechanism.no_weight_decay()}
