"""Loading a saved model on ``attn_implementation="attnscale"``, checked: every weight it needs
comes from the checkpoint, and a mechanism :func:`attnscale.hf.set_mechanism` swapped in is put
back with its tensors."""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from torch import Tensor, nn

from attnscale.errors import ConfigError, parse_json
from attnscale.hf.attention import ATTN_IMPLEMENTATION, MECHANISM_ATTR, register
from attnscale.hf.layers import check_swappable_options, set_mechanism, unsupported

# The weight files save_pretrained writes, in the order transformers prefers them: each single or
# sharded (then ``NAME.index.json`` maps every tensor to its shard).
WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin")
# The keys of a shard index (transformers' save_pretrained writes both; its loader reads both).
INDEX_KEYS = ("metadata", "weight_map")
# The keys of config.json's record of a swapped mechanism (set_mechanism writes both).
MECHANISM_KEYS = ("name", "options")
# The first bytes of a pickle (protocol 2 and later), as torch.save's legacy format starts.
PICKLE_START = b"\x80"


def saved_mechanism(path: str | Path) -> dict | None:
    """The ``{"name", "options"}`` recorded in a saved model's config.json, or None (native).

    Raises:
        ConfigError: no config.json, or a record that is not ``{"name": str, "options":
            {str: value}}`` (``options`` may be left out), naming config.json.
    """
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"{str(path)!r} has no config.json (a folder written by save_pretrained "
                          "is needed).")
    where = f"{MECHANISM_ATTR} in {str(config)!r}"
    try:
        saved = parse_json(str(config), config.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{str(config)!r} is not UTF-8 text ({err.reason}).") from None
    spec = saved.get(MECHANISM_ATTR) if isinstance(saved, dict) else None
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ConfigError(f"{where} must be {{\"name\": str, \"options\": {{...}}}}, got "
                          f"{json.dumps(spec)[:80]}.")
    extra = sorted(set(spec) - set(MECHANISM_KEYS))
    if extra:
        raise ConfigError(f"{where} has unknown key {extra[0]!r}; it holds "
                          f"{' and '.join(MECHANISM_KEYS)} only.")
    options = spec.get("options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: options must be a JSON object of option names and values, "
                          f"got {json.dumps(options)[:80]}.")
    return {"name": spec["name"], "options": options}


def from_pretrained(model_class, path: str | Path, *, param: str = "path", **kwargs) -> nn.Module:
    """``model_class.from_pretrained(path, attn_implementation="attnscale", **kwargs)``, checked,
    with the mechanism recorded by :func:`set_mechanism` put back and its tensors loaded.

    Every tensor of the base model must come from the checkpoint: transformers fills one it
    lacks with random values, which would be measured, run or trained as if it were the trained
    one.  A task head outside the base model (a new classifier, an untied language-model head
    loaded onto a bare checkpoint) may be new; tied tensors and buffers that are not saved are
    never missing.  Tensors whose shapes differ from those the config describes are refused
    unless ``ignore_mismatched_sizes=True`` is passed.

    Args:
        model_class: a transformers class with ``from_pretrained`` (``AutoModelForCausalLM``,
            ``AutoModel``, ``LlamaForCausalLM``...).
        path: a local folder written by ``save_pretrained`` (this function never downloads), or
            the folder of the ``gguf_file`` passed in ``kwargs``.
        param: how errors name ``path`` (``"MODEL_DIR"`` on the command line).
        kwargs: passed on (``dtype``, ``device_map``, ``gguf_file``...); with
            ``output_loading_info=True`` the return is ``(model, info)``, as transformers'.
    Raises:
        ConfigError: ``path`` is not such a folder, another ``attn_implementation`` is asked
            for, a family that cannot run on it, weight files that are not whole, a tensor the
            checkpoint lacks or has in another shape, a malformed or unknown recorded
            mechanism, or its tensors missing from the weights.  Each names ``path``.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{param} {str(path)!r} is not a local folder written by "
                          "save_pretrained.")
    gguf = kwargs.get("gguf_file")
    # A GGUF (kwargs gguf_file) carries its config in its metadata, and no mechanism.
    spec = None if gguf else saved_mechanism(path)
    implementation = kwargs.setdefault("attn_implementation", ATTN_IMPLEMENTATION)
    if implementation != ATTN_IMPLEMENTATION:
        raise ConfigError(f"attn_implementation must be {ATTN_IMPLEMENTATION!r} here, got "
                          f"{implementation!r}.")
    register()
    where = f"{MECHANISM_ATTR} in {str(path / 'config.json')!r}"
    if spec is not None:
        check_swappable_options(spec["name"], spec["options"], where)
    legacy = False if gguf else check_weight_files(path, param)
    want_info = kwargs.pop("output_loading_info", False)
    mismatch_ok = kwargs.pop("ignore_mismatched_sizes", False)
    # transformers' own load report is replaced by the checks below (and it reports the
    # mechanism's tensors as unused weights: they are loaded after set_mechanism).
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model, info = model_class.from_pretrained(path, output_loading_info=True,
                                                  ignore_mismatched_sizes=True, **kwargs)
    except KeyError as err:
        if err.args == (ATTN_IMPLEMENTATION,):  # its layers pick a class by implementation name
            raise unsupported(_model_type(path, kwargs), f"cannot load {param} {str(path)!r}: ") \
                from None
        raise
    except (pickle.UnpicklingError, EOFError, RuntimeError) as err:
        # unpickling raises the first two alone; torch's legacy reader a RuntimeError
        if isinstance(err, RuntimeError) and not legacy:
            raise
        raise ConfigError(f"cannot load {param} {str(path)!r}: its pytorch_model.bin is "
                          f"truncated or corrupt ({_first_line(err)}).") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    check_loaded(model, info, path, param, mismatch_ok=mismatch_ok)
    if spec is not None:
        try:
            set_mechanism(model, spec["name"], **spec["options"])
        except ConfigError as err:  # an option value the mechanism refuses
            raise ConfigError(f"{where}: {err}") from None
        _load_mechanism_tensors(model, path)
    return (model, info) if want_info else model


def check_loaded(model: nn.Module, info: dict, path: Path, param: str = "path", *,
                 mismatch_ok: bool = False) -> None:
    """Refuse a model transformers loaded from ``path`` with a base-model tensor the checkpoint
    did not supply (``info["missing_keys"]``) or, unless ``mismatch_ok``, one whose shape differs
    from the config's (``info["mismatched_keys"]``); the first in the model's own order is named.

    ``info`` is ``from_pretrained(..., output_loading_info=True)``'s second value."""
    order = {key: i for i, key in enumerate(model.state_dict())}
    base = getattr(model, "base_model", model)
    prefix = "" if base is model else f"{model.base_model_prefix}."
    needed = {prefix + key for key in base.state_dict()}
    missing = sorted((k for k in info.get("missing_keys", ()) if k in needed),
                     key=lambda k: order.get(k, len(order)))
    head = f"cannot load {param} {str(path)!r}: "
    if missing:
        unused = sorted(info.get("unexpected_keys", ()))
        more = f" and {len(missing) - 1} more of its {len(needed)} tensors" if len(missing) > 1 \
            else ""
        # most names unmatched: the weights are of another architecture than the config's
        why = (f"; the weights hold {len(unused)} tensors this {model.config.model_type} model "
               f"does not use (e.g. {unused[0]!r}): does the config name the architecture they "
               "were saved from?") if unused and 2 * len(missing) > len(needed) else ""
        raise ConfigError(f"{head}its weights do not supply {missing[0]!r}{more}, which would "
                          f"be random values, not trained ones{why}")
    mismatched = sorted(info.get("mismatched_keys", ()), key=lambda m: order.get(m[0], len(order)))
    if mismatched and not mismatch_ok:
        key, saved, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ConfigError(f"{head}tensor {key!r} is {tuple(saved)} in the weights but "
                          f"{tuple(wanted)} in the model its config describes{more}: the config "
                          "does not match the weights.")


def check_weight_files(path: Path, param: str = "path") -> bool:
    """Refuse weight files of a ``save_pretrained`` folder that cannot be read whole, before
    anything is loaded: a shard index that is not the JSON save_pretrained writes (both
    :data:`INDEX_KEYS`, every tensor mapped to a shard that exists), a safetensors file whose
    header does not describe the file (truncated, or not safetensors), a ``.bin`` that is
    neither the zip torch.save writes nor its legacy pickle, or a zip cut short.  Only headers
    and zip directories are read.  Returns whether the weights are legacy pickles (which only
    their load can check)."""
    from safetensors import SafetensorError, safe_open

    head = f"cannot load {param} {str(path)!r}: "
    for name in WEIGHT_NAMES:
        files = _weight_files(path, name, param)
        if files is None:
            continue
        legacy = False
        for file in sorted(set(files)):
            if file.endswith(".safetensors"):
                try:
                    with safe_open(str(path / file), framework="pt"):
                        pass
                except (SafetensorError, OSError) as err:
                    raise ConfigError(f"{head}{file} is not a whole safetensors file (truncated "
                                      f"or corrupt: {_first_line(err)}).") from None
            else:
                legacy = _check_torch_file(path / file, head) or legacy
        return legacy
    return False


def _weight_files(path: Path, name: str, param: str) -> list[str] | None:
    """The files holding the weights saved as ``name`` (``model.safetensors`` or its shards),
    from its index where there is one (checked), or None when ``path`` has neither."""
    index = path / f"{name}.index.json"
    if index.is_file():
        return list(_weight_map(index, param).values())
    return [name] if (path / name).is_file() else None


def _weight_map(index: Path, param: str) -> dict[str, str]:
    """``{tensor: shard file}`` of a shard index, checked as :func:`check_weight_files` says."""
    head = f"cannot load {param} {str(index.parent)!r}: {index.name}"
    try:
        data = parse_json(index.name, index.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{head} is not UTF-8 text ({err.reason}).") from None
    except ConfigError as err:
        raise ConfigError(f"{head}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{head} must hold a JSON object, got {type(data).__name__}.")
    for key in INDEX_KEYS:
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"{head} has no {key!r} object (save_pretrained writes "
                              f"{' and '.join(INDEX_KEYS)}).")
    weight_map = data["weight_map"]
    bad = next((k for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise ConfigError(f"{head} maps {bad!r} to {weight_map[bad]!r}, not a shard file name.")
    absent = next((v for v in weight_map.values() if not (index.parent / v).is_file()), None)
    if absent is not None:
        raise ConfigError(f"{head} names shard {absent!r}, which is not in the folder.")
    return weight_map


def _check_torch_file(file: Path, head: str) -> bool:
    """A ``.bin`` torch.save wrote: a zip whose directory reads (torch >= 1.6), or a pickle
    (the legacy format, read and checked by the load itself: True)."""
    if zipfile.is_zipfile(file):
        try:
            with zipfile.ZipFile(file) as archive:
                size = file.stat().st_size
                end = max((z.header_offset + z.compress_size for z in archive.infolist()),
                          default=0)
        except (zipfile.BadZipFile, OSError) as err:
            raise ConfigError(f"{head}{file.name} is a corrupt zip ({_first_line(err)}).") \
                from None
        if end > size:
            raise ConfigError(f"{head}{file.name} is truncated (its zip directory reaches byte "
                              f"{end}, past the file's {size}).")
        return False
    with open(file, "rb") as f:
        start = f.read(len(PICKLE_START))
    if start != PICKLE_START:
        raise ConfigError(f"{head}{file.name} is not a PyTorch checkpoint (neither the zip "
                          "torch.save writes nor its legacy pickle; truncated or corrupt).")
    return True


def _model_type(path: Path, kwargs: dict) -> str:
    """The model_type of the checkpoint in ``path`` (a GGUF's architecture), for messages."""
    if kwargs.get("gguf_file"):
        return str(kwargs["gguf_file"])
    try:
        return str(json.loads((path / "config.json").read_text(encoding="utf-8"))["model_type"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


def _first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()),
                type(err).__name__)


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
    for name in WEIGHT_NAMES:
        index = path / f"{name}.index.json"
        if index.is_file():
            weight_map = _weight_map(index, "path")
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
