"""Saving and reloading a model whose temperature :func:`attnscale.hf.set_mechanism` swapped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from torch import Tensor, nn

from attnscale.errors import ConfigError
from attnscale.hf.attention import ATTN_IMPLEMENTATION, MECHANISM_ATTR, register
from attnscale.hf.layers import check_swappable_options, set_mechanism

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
    # A GGUF (kwargs gguf_file) carries its config in its metadata, and no mechanism.
    spec = None if kwargs.get("gguf_file") else saved_mechanism(path)
    implementation = kwargs.setdefault("attn_implementation", ATTN_IMPLEMENTATION)
    if implementation != ATTN_IMPLEMENTATION:
        raise ConfigError(f"attn_implementation must be {ATTN_IMPLEMENTATION!r} here, got "
                          f"{implementation!r}.")
    register()
    if spec is None:
        return model_class.from_pretrained(path, **kwargs)
    check_swappable_options(spec["name"], spec.get("options", {}),
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
