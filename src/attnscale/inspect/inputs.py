"""What ``attnscale inspect`` reads: a local model folder (never downloaded), its tokenizer, the
text, and the same architecture freshly initialised.

Every check that needs no model runs before transformers is imported, so a bad folder or text is
refused in a second.  Error messages name the parameter as the caller spells it (``text`` from
Python, ``--text`` from the command line).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from attnscale.errors import ConfigError, check_choice, check_int, check_int_list, parse_json
from attnscale.rng import rng
from attnscale.workers import check_device

# Files whose presence means the folder ships a tokenizer (any one is enough for AutoTokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")
# Weight files of a save_pretrained folder: single-file or sharded (with its index).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# The dtypes a model can be run in; "auto" is the dtype it was saved in.
DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
# The default text's first part: the licence of the running Python, English prose that ships
# with CPython (lib/python3.X/LICENSE.txt); the standard library's .py files (the LM corpus,
# attnscale.experiments.lm.data) follow where it is too short or missing.
LICENSE_FILE = "LICENSE.txt"


def check_model_dir(model_dir: str | os.PathLike, param: str = "model_dir") -> tuple[Path, dict]:
    """``model_dir`` as a folder written by ``save_pretrained``, and its config.json.

    Raises:
        ConfigError: '' or a missing folder, no config.json or one that is not a JSON object, no
            weight file (:data:`WEIGHT_FILES`).
    """
    if model_dir is None or not str(model_dir).strip():
        raise ConfigError(f"{param} must be a path, got {str(model_dir or '')!r}.")
    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigError(f"{param} {str(model_dir)!r} is not a directory (attnscale never "
                          "downloads; pass a local model folder).")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{param} {str(model_dir)!r} has no config.json (save the model with "
                          "save_pretrained).")
    try:
        config = parse_json("config.json", config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{param} {str(model_dir)!r}: config.json is not valid JSON "
                          f"({err}).") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{param} {str(model_dir)!r}: config.json must hold a JSON object, got "
                          f"a {type(config).__name__}.")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"{param} {str(model_dir)!r} has no weights ({', '.join(WEIGHT_FILES)}); "
                          "a checkpoint saved with save_pretrained has one.")
    return path, config


def read_text(path: str | os.PathLike, param: str = "text") -> str:
    """The UTF-8 text of file ``path``; a missing, non-UTF-8 or empty file is a ConfigError."""
    if path is None or not str(path).strip():
        raise ConfigError(f"{param} must be a path, got {str(path or '')!r}.")
    if not Path(path).is_file():
        raise ConfigError(f"{param} {str(path)!r} is not a file.")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{param} {str(path)!r} is not UTF-8 text (byte "
                          f"{err.object[err.start]:#04x} at offset {err.start}).") from None
    if not text.strip():
        raise ConfigError(f"{param} {str(path)!r} is empty.")
    return text


def default_text(min_chars: int) -> tuple[str, str]:
    """At least ``min_chars`` characters of text that ships with Python, and where it came from:
    :data:`LICENSE_FILE` of the standard library, then its ``.py`` files in the LM corpus's order
    (:func:`attnscale.experiments.lm.data.stdlib_files`) as far as needed."""
    from attnscale.experiments.lm.data import stdlib_files

    root, files = stdlib_files()
    parts, used = [], []
    licence = Path(sysconfig.get_paths()["stdlib"]) / LICENSE_FILE
    for path in ([licence] if licence.is_file() else []) + files:
        if sum(map(len, parts)) >= min_chars:
            break
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        used.append(path)
    if not used:
        raise ConfigError(f"no text ships with this Python under {str(root)!r}; pass one.")
    names = [p.name for p in used[:2]] + ([f"{len(used) - 2} more files"] if len(used) > 2 else [])
    return "\n".join(parts), f"Python {sysconfig.get_python_version()} stdlib: " + ", ".join(names)


@dataclass(frozen=True)
class Tokens:
    """The input of the forward passes: ``ids`` (1, N) int64, ``source`` in words, and ``kind``:
    ``"text"`` (the caller's), ``"default"`` (text that ships with Python) or ``"random"``."""
    ids: Tensor
    source: str
    kind: str


def token_ids(tokenizer, text: str | None, seq_len: int, *, vocab_size: int, seed: int = 0,
              text_param: str = "text", seq_len_param: str = "seq_len") -> Tokens:
    """The first ``seq_len`` tokens of ``text`` (the default text when None), or ``seq_len``
    seeded random ids when there is no tokenizer.

    Raises:
        ConfigError: an empty text, a text that gives fewer than ``seq_len`` tokens, or a text
            given to a model folder without a tokenizer.
    """
    seq_len = check_int(seq_len_param, seq_len, minimum=1)
    if text is not None and not text.strip():
        raise ConfigError(f"{text_param} is empty.")
    if tokenizer is None:
        if text is not None:
            raise ConfigError(f"{text_param} was given, but the model folder has no tokenizer "
                              f"({', '.join(TOKENIZER_FILES)}) to read it with.")
        ids = torch.randint(0, int(vocab_size), (1, seq_len), generator=rng(seed))
        return Tokens(ids, f"{seq_len} random token ids (seed {seed}; the model folder has no "
                           "tokenizer)", "random")
    if text is not None:
        ids = _encode(tokenizer, text)
        if ids.shape[1] < seq_len:
            raise ConfigError(f"{text_param} gives {ids.shape[1]} tokens, fewer than "
                              f"{seq_len_param} {seq_len}; pass a longer text or a smaller "
                              f"{seq_len_param}.")
        return Tokens(ids[:, :seq_len], f"the given text (first {seq_len} tokens)", "text")
    chars = 8 * seq_len
    while True:  # the default text, read as far as the tokens need
        body, source = default_text(chars)
        ids = _encode(tokenizer, body)
        if ids.shape[1] >= seq_len or len(body) < chars:
            break
        chars *= 4
    if ids.shape[1] < seq_len:
        raise ConfigError(f"the default text gives only {ids.shape[1]} tokens, fewer than "
                          f"{seq_len_param} {seq_len}; pass a longer text.")
    return Tokens(ids[:, :seq_len], f"{source} (first {seq_len} tokens)", "default")


def _encode(tokenizer, text: str) -> Tensor:
    """(1, n) int64 token ids of ``text``, special tokens included (as the model was trained)."""
    return tokenizer(text, return_tensors="pt", truncation=False,
                     verbose=False)["input_ids"].to(torch.int64)


def resolve_device(device: str | None, param: str = "device") -> torch.device:
    """``auto`` or None (CUDA where available, else the CPU), or any device
    :func:`attnscale.workers.check_device` accepts (``cpu``, ``cuda``, ``cuda:N``...)."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(param, device)


def load_model(model_dir: Path, *, dtype: str = "auto", device: torch.device | None = None,
               param: str = "model_dir", gguf_file: str | None = None,
               auto_class: str = "AutoModel", device_map: str | None = None):
    """The model (``attn_implementation="attnscale"``, eval mode, with the mechanism it was saved
    with) and its tokenizer (None when the folder has none); transformers' own progress bars and
    load reports are silenced.

    ``gguf_file``: the name of a ``.gguf`` file in ``model_dir``, read by transformers' GGUF loader
    (dequantised; the tokenizer comes from the file).  ``auto_class``: the transformers Auto class
    to build (``"AutoModelForCausalLM"`` for a language-model head).  ``device_map``: passed to
    ``from_pretrained`` (``"auto"`` places the layers with accelerate); ``device`` is then not
    applied."""
    transformers = _transformers()
    from safetensors import SafetensorError

    from attnscale import hf

    check_choice("dtype", dtype, DTYPES)
    hf.register()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        extra = {} if gguf_file is None else {"gguf_file": gguf_file}
        if device_map is not None:
            extra["device_map"] = device_map
        model = hf.from_pretrained(getattr(transformers, auto_class), model_dir,
                                   local_files_only=True, **extra,
                                   dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    except ConfigError:
        raise
    except (ValueError, KeyError, OSError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"cannot load {param} {str(model_dir)!r}: {first}") from None
    tokenizer = None
    if gguf_file is not None:
        if gguf_has_tokenizer(Path(model_dir) / gguf_file):
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                model_dir, gguf_file=gguf_file, local_files_only=True)
    elif any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if device_map is None:
        model = model.to(device or "cpu")
    return model.eval(), tokenizer


def fresh_model(model: nn.Module, seed: int) -> nn.Module:
    """The same architecture, freshly initialised by its own ``_init_weights`` under
    ``torch.manual_seed(seed)`` (the global generator is restored afterwards), in the dtype and
    on the device of ``model``; a swapped mechanism is swapped in again, freshly built."""
    transformers = _transformers()
    from attnscale import hf

    swapped = getattr(model.config, hf.MECHANISM_ATTR, None)
    config = model.config.__class__.from_dict(model.config.to_dict())
    if swapped is not None:  # set again below, on the fresh layers
        delattr(config, hf.MECHANISM_ATTR)
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)
    devices = [weight.device] if weight is not None and weight.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        fresh = transformers.AutoModel.from_config(config, attn_implementation="attnscale")
    if weight is not None:
        fresh = fresh.to(device=weight.device, dtype=weight.dtype)
    if swapped is not None:
        hf.set_mechanism(fresh, swapped["name"], **swapped.get("options", {}))
    return fresh.eval()


def model_inputs(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    """The keyword arguments of one forward pass on ``ids``: encoder-decoders read the same
    tokens on both sides."""
    ids = ids.to(next(model.parameters()).device)
    if getattr(model.config, "is_encoder_decoder", False):
        return {"input_ids": ids, "decoder_input_ids": ids}
    return {"input_ids": ids}


def check_seq_len(model: nn.Module, seq_len: int, param: str = "seq_len") -> None:
    """``seq_len`` must fit the model's position table (learned positions index past it)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ConfigError(f"{param} {seq_len} exceeds the model's maximum of {limit} positions "
                          "(max_position_embeddings in config.json).")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("attnscale inspect needs transformers: pip install 'attnscale[hf]'") \
            from None
    return transformers


# The GGUF metadata key holding a tokenizer's vocabulary (the GGUF specification, ggml's
# docs/gguf.md): a file without it carries no tokenizer.
GGUF_TOKENS_KEY = "tokenizer.ggml.tokens"


def gguf_has_tokenizer(path: Path) -> bool:
    """Whether the GGUF file ``path`` stores a tokenizer (its vocabulary)."""
    import gguf
    return GGUF_TOKENS_KEY in gguf.GGUFReader(path).fields


def check_lengths(lengths, available: int | None = None, param: str = "lengths") -> list[int]:
    """``lengths`` as distinct positive token counts in increasing order, none beyond
    ``available`` (the tokens there are to read)."""
    out = sorted(check_int_list(param, lengths, minimum=1))
    if available is not None and out[-1] > available:
        raise ConfigError(f"{param}: {out[-1]} exceeds the {available} tokens given.")
    return out


def reinitialise(model: nn.Module, seed: int) -> nn.Module:
    """Re-initialise ``model`` in place, as :func:`fresh_model` initialises a new one: every
    module's own ``reset_parameters`` and then the family's ``_init_weights``, under
    ``torch.manual_seed(seed)`` (the global generator is restored afterwards).  Its trained
    weights are overwritten, so one copy of the weights is held; the mechanism it runs stays."""
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)
    devices = [weight.device] if weight is not None and weight.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        _initialise(model)
    return model.eval()


def _initialise(model: nn.Module) -> None:
    """Draw ``model``'s weights as ``AutoModel.from_config`` draws a new one's: each module's
    ``reset_parameters`` in construction order (the modules' pre-order), then the family's
    ``_init_weights`` over every module (transformers' ``init_weights``), with transformers'
    "already initialised" marks that a load leaves cleared first; a swapped mechanism is built
    afresh afterwards, as :func:`fresh_model` does."""
    from attnscale import hf

    swapped = getattr(model.config, hf.MECHANISM_ATTR, None)
    if swapped is not None:
        hf.set_mechanism(model, None)
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if "_is_hf_initialized" in tensor.__dict__:
                del tensor._is_hf_initialized
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if module is not model and callable(reset):
            reset()
    model.init_weights()
    if swapped is not None:
        hf.set_mechanism(model, swapped["name"], **swapped.get("options", {}))
