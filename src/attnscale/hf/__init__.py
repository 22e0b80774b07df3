"""Hugging Face transformers integration: run, watch and swap the attention temperature of HF models.

Install with ``pip install 'attnscale[hf]'`` (transformers >= 4.56, < 6).

::

    import attnscale.hf
    attnscale.hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnscale")
    attnscale.hf.set_mechanism(model, "qk-rmsnorm")     # optional: swap the temperature owner

**Native temperature.**  Without :func:`set_mechanism` the ``"attnscale"`` implementation keeps
the model's own temperature: the ``scaling`` HF passes (``head_dim ** -0.5``, or Gemma 2's
``query_pre_attn_scalar ** -0.5``), the ``softcap`` it passes (Gemma 2's
``attn_logit_softcapping``, which HF's own ``"sdpa"`` path refuses), and grouped-query attention.
Outputs equal HF's ``"eager"`` attention, but run on attnscale's fused SDPA path, or its blockwise
soft-cap kernel, so no (B, H, N, N) tensor is formed.

**Swapped temperature.**  :func:`set_mechanism` gives every attention layer a registered mechanism
as the submodule ``attnscale_mechanism``; its learned parameters (``qknorm``'s g, ``cosine``'s τ,
``qk-rmsnorm``'s gains...) train and save with the model.  The mechanism acts on the per-head q
and k that HF passes to the attention function, i.e. **after** the projections, any q/k norm of the
architecture and RoPE: ``qk-rmsnorm`` here normalises rotated vectors (RMSNorm commutes with the
rotation except for its per-channel gain), and the mechanism replaces the model's ``scaling`` and
``softcap`` entirely.  Mechanisms whose effect lives in W_Q and W_K (``init-reparam``,
``sigma-reparam``) are refused; use :class:`attnscale.MultiHeadAttention` for those.

**Saving and reloading.**  :func:`set_mechanism` also records ``{"name", "options"}`` as
``config.attnscale_mechanism``, so ``save_pretrained`` writes it to ``config.json`` next to the
mechanism's tensors.  transformers' own ``from_pretrained`` does not know the added submodules (it
would load the native temperature and drop their tensors); :func:`from_pretrained` loads the model,
puts the recorded mechanism back and loads its tensors from the checkpoint::

    model = attnscale.hf.from_pretrained(AutoModelForCausalLM, "runs/qk-rmsnorm-model")
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
    from packaging.version import Version  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("attnscale.hf needs transformers: pip install 'attnscale[hf]'") from err

from attnscale.hf.attention import (
    ATTN_IMPLEMENTATION, MECHANISM_ATTR, MIN_TRANSFORMERS, POSITION_BIAS_KWARG, SINK_KWARG,
    NativeTemperature, WithSinks, attnscale_attention_forward, attnscale_mask, register,
)
from attnscale.hf.callback import TemperatureCallback
from attnscale.hf.checkpoint import from_pretrained, saved_mechanism
from attnscale.hf.layers import (
    attention_layers, check_supported, check_swappable, set_mechanism,
)

__all__ = ["ATTN_IMPLEMENTATION", "MECHANISM_ATTR", "MIN_TRANSFORMERS", "POSITION_BIAS_KWARG",
           "SINK_KWARG", "NativeTemperature", "TemperatureCallback", "WithSinks",
           "attention_layers", "attnscale_attention_forward", "attnscale_mask", "check_supported",
           "check_swappable", "from_pretrained", "register", "saved_mechanism", "set_mechanism"]
