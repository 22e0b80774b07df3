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

import functools
import inspect
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from attnscale.attention import attention
from attnscale.errors import ConfigError
from attnscale.mechanisms import MECHANISMS, Mechanism, build_mechanism, check_mechanism
from attnscale.mechanisms.base import Scale, inv_sqrt
from attnscale.pipeline import MASKED_BIAS

try:
    import transformers
    from packaging.version import Version
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("attnscale.hf needs transformers: pip install 'attnscale[hf]'") from err

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


def _uses_interface(module: nn.Module) -> bool:
    """Whether ``module.forward`` dispatches through HF's ALL_ATTENTION_FUNCTIONS."""
    forward = inspect.unwrap(type(module).forward)  # past HF's deprecation decorators
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every attention layer that goes through HF's interface."""
    return [(name, m) for name, m in model.named_modules()
            if _uses_interface(m) and getattr(m, "head_dim", None)]


def check_supported(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`attention_layers`, or a ConfigError naming the family when there are none."""
    layers = attention_layers(model)
    if not layers:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(f"model family {family!r} does not route attention through "
                          "transformers' AttentionInterface, so attnscale cannot run, observe or "
                          "swap its temperature.")
    return layers


def _n_heads(layer: nn.Module) -> int:
    config = getattr(layer, "config", None)
    n = getattr(config, "num_attention_heads", None) or getattr(layer, "num_heads", None)
    if not n:
        raise ConfigError(f"cannot tell the number of heads of {type(layer).__name__}.")
    return int(n)


def check_swappable(name: str, **options) -> None:
    """ConfigError unless :func:`set_mechanism` can install ``name`` with options of these names.

    Checks the name and option names without building anything (the option values are checked
    when :func:`set_mechanism` builds each layer's mechanism, before it changes the model).
    """
    _check_swappable(name, options, "name")


def _check_swappable(name: str, options: dict, param: str) -> None:
    """:func:`check_swappable`, with errors prefixed by ``param``, where the name came from."""
    check_mechanism(name, options, param=param)  # unknown name or option: did-you-mean
    if MECHANISMS[name].gate:
        raise ConfigError(f"mechanism {name!r} gates the attention output with the layer's "
                          "input, which HF's attention function does not see; use "
                          "attnscale.MultiHeadAttention or attnscale.lm for it.")
    if not MECHANISMS[name].defined_at_init:
        raise ConfigError(f"mechanism {name!r} acts on the W_Q and W_K weights, not on the q and "
                          "k HF passes to the attention function; use "
                          "attnscale.MultiHeadAttention for it.")


def _require_attnscale(layer: nn.Module, args) -> None:
    """Forward pre-hook of a layer holding a mechanism: its attention must still run on
    ``"attnscale"``.  However the implementation was changed afterwards
    (``model.set_attn_implementation("sdpa")``, ``config._attn_implementation = ...``), another
    one would drop the mechanism silently while ``config.attnscale_mechanism`` still names it."""
    implementation = getattr(getattr(layer, "config", None), "_attn_implementation", None)
    if hasattr(layer, MECHANISM_ATTR) and implementation != ATTN_IMPLEMENTATION:
        name = getattr(getattr(layer, MECHANISM_ATTR), "name", "") or "a mechanism"
        raise ConfigError(f"{type(layer).__name__} holds mechanism {name!r}, which only "
                          f"attn_implementation={ATTN_IMPLEMENTATION!r} applies, but the model now "
                          f"runs {implementation!r}: set it back, or remove the mechanism first "
                          "with attnscale.hf.set_mechanism(model, None).")


def set_mechanism(model: nn.Module, name: str | None, **options) -> list[str]:
    """Make mechanism ``name`` own the temperature of every attention layer of ``model``.

    Each layer gets a fresh ``build_mechanism(name, head_dim, num_attention_heads, **options)``
    as its submodule ``attnscale_mechanism`` (in the dtype and device of the layer's weights), and
    the model is switched to ``attn_implementation="attnscale"``.  ``name=None`` removes them and
    restores the native temperature.  Returns the qualified names of the layers changed.

    Only ``"attnscale"`` applies the mechanism: a forward pass after the implementation was
    changed (``model.set_attn_implementation("sdpa")``, ``config._attn_implementation = ...``)
    is a ConfigError, not a silent return to the native temperature.

    Raises:
        ConfigError: unknown name or option (with a did-you-mean), a mechanism that acts on
            W_Q/W_K (init-reparam, sigma-reparam), or a model family outside the interface.
    """
    layers = check_supported(model)
    mechanisms = {}
    if name is not None:
        check_swappable(name, **options)
        # Built before anything changes, so a bad option value leaves the model as it was.
        for qualified, layer in layers:
            weight = next((p for p in layer.parameters() if p.is_floating_point()), None)
            mechanism = build_mechanism(name, layer.head_dim, _n_heads(layer), **options)
            if weight is not None:
                mechanism = mechanism.to(device=weight.device, dtype=weight.dtype)
            mechanisms[qualified] = mechanism
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for qualified, layer in layers:
        if hasattr(layer, MECHANISM_ATTR):
            delattr(layer, MECHANISM_ATTR)
        if name is not None:  # a submodule: trains and saves with the model
            setattr(layer, MECHANISM_ATTR, mechanisms[qualified])
            if not any(hook is _require_attnscale for hook in layer._forward_pre_hooks.values()):
                layer.register_forward_pre_hook(_require_attnscale)
    if name is None:
        if hasattr(model.config, MECHANISM_ATTR):
            delattr(model.config, MECHANISM_ATTR)
    else:  # written to config.json by save_pretrained; read back by from_pretrained below
        setattr(model.config, MECHANISM_ATTR, {"name": name, "options": dict(options)})
    return [qualified for qualified, _ in layers]


def saved_mechanism(path: str | Path) -> dict | None:
    """The ``{"name", "options"}`` recorded in a saved model's config.json, or None (native)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"{str(path)!r} has no config.json (a folder written by save_pretrained "
                          "is needed).")
    spec = json.loads(config.read_text(encoding="utf-8")).get(MECHANISM_ATTR)
    if spec is not None and (not isinstance(spec, dict) or not isinstance(spec.get("name"), str)):
        raise ConfigError(f"config.json in {str(path)!r} has a malformed {MECHANISM_ATTR!r}: "
                          f"{spec!r}")
    return spec


def from_pretrained(model_class, path: str | Path, **kwargs) -> nn.Module:
    """``model_class.from_pretrained(path, attn_implementation="attnscale", **kwargs)``, with the
    mechanism recorded by :func:`set_mechanism` put back and its tensors loaded.

    Args:
        model_class: a transformers class with ``from_pretrained`` (``AutoModelForCausalLM``,
            ``AutoModel``, ``LlamaForCausalLM``...).
        path: a local folder written by ``save_pretrained`` (this function never downloads).
        kwargs: passed on (``torch_dtype``, ``device_map``...).
    Raises:
        ConfigError: ``path`` is not such a folder, another ``attn_implementation`` is asked
            for, the recorded mechanism is unknown, or its tensors are missing from the weights.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"path {str(path)!r} is not a local folder written by save_pretrained.")
    spec = saved_mechanism(path)
    implementation = kwargs.setdefault("attn_implementation", ATTN_IMPLEMENTATION)
    if implementation != ATTN_IMPLEMENTATION:
        raise ConfigError(f"attn_implementation must be {ATTN_IMPLEMENTATION!r} here, got "
                          f"{implementation!r}.")
    register()
    if spec is None:
        return model_class.from_pretrained(path, **kwargs)
    _check_swappable(spec["name"], spec.get("options", {}),
                     f"{MECHANISM_ATTR} in {str(path / 'config.json')!r}")
    # transformers reports the mechanism's tensors as unused weights: they are loaded below.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = model_class.from_pretrained(path, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)
    set_mechanism(model, spec["name"], **spec.get("options", {}))
    _load_mechanism_tensors(model, path)
    return model


def _load_mechanism_tensors(model: nn.Module, path: Path) -> None:
    """Copy every mechanism tensor of ``model`` from the checkpoint in ``path``.

    The checkpoint may have been saved from a model with or without the base-model prefix
    (``model.layers...`` from a ``*ForCausalLM``, ``layers...`` from the base model)."""
    marker = f"{MECHANISM_ATTR}."
    wanted = [key for key in model.state_dict() if marker in key]
    if not wanted:
        return
    found = dict(_checkpoint_tensors(path, lambda key: marker in key))
    prefix = f"{model.base_model_prefix}."
    state = {}
    for key in wanted:
        for candidate in (key, prefix + key, key.removeprefix(prefix)):
            if candidate in found:
                state[key] = found[candidate]
                break
    missing = [key for key in wanted if key not in state]
    if missing:
        raise ConfigError(f"the weights in {str(path)!r} lack {len(missing)} tensor(s) of the "
                          f"recorded mechanism, e.g. {missing[0]!r}; was the model saved after "
                          "set_mechanism?")
    model.load_state_dict(state, strict=False)


def _checkpoint_tensors(path: Path, keep) -> Iterator[tuple[str, Tensor]]:
    """(key, tensor) of the saved weights in ``path`` whose key passes ``keep``: single-file or
    sharded safetensors, or PyTorch ``.bin`` files."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        index = path / f"{name}.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({file for key, file in weight_map.items() if keep(key)})
        elif (path / name).is_file():
            files = [name]
        else:
            continue
        for file in files:
            if file.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(str(path / file), framework="pt") as f:
                    for key in f.keys():
                        if keep(key):
                            yield key, f.get_tensor(key)
            else:
                state = torch.load(path / file, map_location="cpu", weights_only=True)
                yield from ((key, t) for key, t in state.items() if keep(key))
        return
    raise ConfigError(f"no model.safetensors or pytorch_model.bin (or their index) in "
                      f"{str(path)!r}.")


from attnscale.hf_callback import TemperatureCallback  # noqa: E402,F401  (the guard in Trainer)
