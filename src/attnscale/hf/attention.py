"""The ``"attnscale"`` entry of transformers' AttentionInterface: HF's attention call on attnscale's
pipeline, with the model's own temperature (:class:`NativeTemperature`) unless a mechanism was
installed by :func:`attnscale.hf.set_mechanism`."""

from __future__ import annotations

import functools

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn

from attnscale.attention import attention
from attnscale.errors import ConfigError
from attnscale.mechanisms import Mechanism
from attnscale.mechanisms.base import Scale, inv_sqrt
from attnscale.pipeline import MASKED_BIAS

# The attention implementation name, for from_pretrained(..., attn_implementation=...).
ATTN_IMPLEMENTATION = "attnscale"
# Attribute (and state_dict prefix) of the swapped mechanism on each attention layer, and the
# config attribute that records it ({"name": ..., "options": {...}}) for save_pretrained.
MECHANISM_ATTR = "attnscale_mechanism"
# Attention-function arguments that change the softmax and that this implementation lacks:
# T5-style additive position biases.
UNSUPPORTED_KWARGS = ("position_bias",)
# gpt-oss passes its learned per-head attention sinks (H,) under this name (HF transformers
# modeling_gpt_oss.py); they are kept, as the pipeline's "sink" normaliser.
SINK_KWARG = "s_aux"
# Oldest transformers whose AttentionInterface / AttentionMaskInterface / sdpa_mask this uses.
MIN_TRANSFORMERS = "4.56"


class NativeTemperature(Mechanism):
    """The model's own temperature: z = scaling · qᵀk, then c · tanh(z / c) when HF passes a cap.

    Not in the registry: its constants come from the model (``module.scaling``, the config's
    ``attn_logit_softcapping``), not from a name.
    """

    def __init__(self, d_head: int, n_heads: int, *, scaling: float, cap: float | None):
        super().__init__(d_head, n_heads)
        self.scaling = float(scaling)
        self.cap = None if cap is None else float(cap)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.scaling:g}, cap={self.cap}"


@functools.lru_cache(maxsize=None)
def _native(d_head: int, n_heads: int, scaling: float, cap: float | None) -> NativeTemperature:
    # One parameter-free instance per distinct temperature, instead of one per call.
    return NativeTemperature(d_head, n_heads, scaling=scaling, cap=cap)


class WithSinks:
    """A rule with the model's own attention sinks: ``rule``'s temperature, then the softmax with
    one sink logit per head (gpt-oss's ``sinks``, passed as ``s_aux``), the pipeline's ``"sink"``
    normaliser.  Everything but the normaliser is ``rule``'s; not an ``nn.Module``, so the sinks
    stay the model's parameter (trained and saved as HF's)."""

    normaliser = "sink"

    def __init__(self, rule: Mechanism, sinks: Tensor):
        if rule.normaliser != "softmax":
            raise ConfigError(f"mechanism {rule.name or type(rule).__name__!r} brings its own "
                              f"{rule.normaliser!r} normaliser; it cannot replace the temperature "
                              "of a model with attention sinks (s_aux).")
        self.rule, self.sinks = rule, sinks

    def __getattr__(self, name: str):
        return getattr(self.rule, name)

    def sink_logits(self) -> Tensor:
        return self.sinks


def _bool_mask(mask: Tensor | None) -> Tensor | None:
    """HF's mask as attnscale's (True = attend); additive 0/-inf masks are converted."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    keep = mask > MASKED_BIAS
    if bool((mask[keep] != 0).any()):
        raise ConfigError("attention_mask carries additive position biases, which "
                          "attn_implementation='attnscale' does not support.")
    return keep


def attnscale_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                attention_mask: Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, softcap: float | None = None,
                                is_causal: bool | None = None, **kwargs) -> tuple[Tensor, None]:
    """The ``"attnscale"`` entry of HF's AttentionInterface.

    Args:
        module: the HF attention layer (its ``attnscale_mechanism``, if set, owns the temperature).
        query: (B, H, Nq, d) after RoPE; key, value: (B, Hk, Nk, d) with ``H % Hk == 0``.
        attention_mask: boolean (B, 1, Nq, Nk) from ``sdpa_mask`` (True = attend), or None for
            plain causal (or, with one query, full) attention, as in HF's SDPA integration.
            Sliding windows and padding arrive in this mask.
    Returns:
        ``(output (B, Nq, H, d), None)``; attention weights are never materialised.
    """
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:  # ignoring them would silently change the attention
            raise ConfigError(f"attn_implementation='attnscale' does not support {name!r} "
                              f"({type(module).__name__}).")
    if dropout and module.training:
        raise ConfigError("attention dropout > 0 in training is not supported by "
                          "attn_implementation='attnscale'; set config.attention_dropout = 0.")
    n_heads, d_head = query.shape[1], query.shape[-1]
    mechanism = getattr(module, MECHANISM_ATTR, None)
    recorded = getattr(getattr(module, "config", None), MECHANISM_ATTR, None)
    if mechanism is None and recorded is not None:
        # Loaded by transformers' own from_pretrained: the config names a mechanism the layers
        # lack, and the native temperature would run under that name.
        raise ConfigError(f"config.{MECHANISM_ATTR} records {recorded.get('name')!r} but "
                          f"{type(module).__name__} has no mechanism: load the model with "
                          "attnscale.hf.from_pretrained, or call attnscale.hf.set_mechanism.")
    if mechanism is None:
        mechanism = _native(d_head, n_heads, inv_sqrt(d_head) if scaling is None else scaling,
                            softcap)
    sinks = kwargs.get(SINK_KWARG)
    if sinks is not None:  # gpt-oss: keep the model's own learned sinks
        mechanism = WithSinks(mechanism, sinks)
    groups = n_heads // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)      # (B, H, Nk, d), O(N d) memory
        value = value.repeat_interleave(groups, dim=1)
    mask = _bool_mask(attention_mask)
    causal = False
    if mask is None:
        # HF's SDPA rule: no mask means causal (when the layer is) unless there is one query.
        causal = query.shape[2] > 1 and bool(getattr(module, "is_causal", True)
                                             if is_causal is None else is_causal)
        if causal and key.shape[2] > query.shape[2]:
            # As HF's SDPA path: a causal prefill into a longer, empty static cache.
            key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
    out = attention(query, key, value, mechanism, mask=mask, causal=causal)  # (B, H, Nq, d)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the ``"attnscale"`` attention implementation (and its mask function) with HF.

    Idempotent.  After it, ``from_config(cfg, attn_implementation="attnscale")`` and
    ``from_pretrained(path, attn_implementation="attnscale")`` work.
    """
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"attnscale.hf needs transformers >= {MIN_TRANSFORMERS}, found "
                          f"{transformers.__version__}: pip install 'attnscale[hf]'")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, attnscale_attention_forward)
    # Same masks as "sdpa": boolean, True = attend, or None when `causal` says it all.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


