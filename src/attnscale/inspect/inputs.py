"""What ``attnscale inspect`` reads: a local model folder (never downloaded), its tokenizer, the
text, and the same architecture freshly initialised.

Every check that needs no model runs before transformers is imported, so a bad folder or text is
refused in a second; a loaded model is checked before its first pass (:func:`check_inspectable`:
attention on ``"attnscale"``, token ids read), and a text is tokenised only as far as its tokens
need (:func:`encode_prefix`).  Error messages name the parameter as the caller spells it
(``text`` from Python, ``--text`` from the command line).
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from attnscale import families
from attnscale.errors import (ConfigError, check_choice, check_int, check_int_list, parse_json,
                              spelled)
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
# The largest seed: torch.Generator.manual_seed takes an unsigned 64-bit integer.
MAX_SEED = 2**64 - 1
# Characters of text tokenised at first per token wanted (English prose runs about 4 characters
# a token); the prefix grows 4-fold until it gives enough tokens.
CHARS_PER_TOKEN = 8
# Tokens a text prefix must give beyond those kept, so that its cut end (a word split in a
# script without spaces, the special tokens a tokenizer appends) never reaches a kept token.
PREFIX_SLACK_TOKENS = 16


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
    from attnscale.corpus import stdlib_files

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
    seeded random ids when there is no tokenizer.  Only as much of the text is tokenised as
    those tokens need (:func:`encode_prefix`).

    Raises:
        ConfigError: an empty text, a text that gives fewer than ``seq_len`` tokens or unknown
            tokens only, a text given to a model folder without a tokenizer, a tokenizer that
            gives an id of ``vocab_size`` or more (it is not the model's), a bad seed.
    """
    seq_len = check_int(seq_len_param, seq_len, minimum=1)
    seed = check_seed(seed)
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
        ids = encode_prefix(tokenizer, text, seq_len)
        if ids.shape[1] < seq_len:
            raise ConfigError(f"{text_param} gives {ids.shape[1]} tokens, fewer than "
                              f"{seq_len_param} {seq_len}; pass a longer text or a smaller "
                              f"{seq_len_param}.")
        _check_ids(tokenizer, ids, vocab_size, text_param)
        return Tokens(ids, f"the given text (first {seq_len} tokens)", "text")
    chars = CHARS_PER_TOKEN * (seq_len + PREFIX_SLACK_TOKENS)
    while True:  # the default text, read as far as the tokens need
        body, source = default_text(chars)
        ids = encode_prefix(tokenizer, body, seq_len)
        if ids.shape[1] >= seq_len or len(body) < chars:
            break
        chars *= 4
    if ids.shape[1] < seq_len:
        raise ConfigError(f"the default text gives only {ids.shape[1]} tokens, fewer than "
                          f"{seq_len_param} {seq_len}; pass a longer text.")
    _check_ids(tokenizer, ids, vocab_size, "the default text")
    return Tokens(ids, f"{source} (first {seq_len} tokens)", "default")


def encode_prefix(tokenizer, text: str, n_tokens: int) -> Tensor:
    """(1, n) int64 ids of the first ``n_tokens`` tokens of ``text`` (all of them, n < n_tokens,
    when it gives fewer), tokenising only a prefix of it.

    The prefix starts at :data:`CHARS_PER_TOKEN` characters a token and grows 4-fold (the work
    is then at most 4/3 of the last prefix's); it ends before a whitespace where there is one in
    its second half, so that no word is cut, and it is used once it gives
    :data:`PREFIX_SLACK_TOKENS` more tokens than kept: the tokens kept are those of the whole
    text.  A text shorter than the prefix is tokenised whole."""
    chars = CHARS_PER_TOKEN * (n_tokens + PREFIX_SLACK_TOKENS)
    while chars < len(text):
        cut = _word_end(text, chars)
        ids = _encode(tokenizer, text[:cut])
        if ids.shape[1] >= n_tokens + PREFIX_SLACK_TOKENS:
            return ids[:, :n_tokens]
        chars *= 4
    return _encode(tokenizer, text)[:, :n_tokens]


def _word_end(text: str, chars: int) -> int:
    """Where to cut ``text`` near ``chars``: at the last whitespace of ``text[chars // 2:
    chars + 1]`` (the prefix then ends with a whole word), else at ``chars``."""
    for i in range(chars, chars // 2, -1):
        if text[i].isspace():
            return i
    return chars


def _check_ids(tokenizer, ids: Tensor, vocab_size: int, what: str) -> None:
    """Refuse token ids the model cannot read, an id beyond its ``vocab_size`` embeddings (the
    embedding lookup would fail on it): the tokenizer is not the model's."""
    top = int(ids.max())
    if top >= int(vocab_size):
        piece = tokenizer.convert_ids_to_tokens(top)
        raise ConfigError(f"the tokenizer gives token id {top} ({piece!r}) for {what}, beyond the "
                          f"model's {int(vocab_size)} token ids (vocab_size): the tokenizer and "
                          "the weights are not of one model.")


def check_seed(seed: object, param: str | None = None) -> int:
    """``seed`` as an integer in [0, :data:`MAX_SEED`] (``param``: its name in messages; by
    default ``--seed`` on the command line, ``seed`` from Python)."""
    param = param or spelled("--seed", "seed")
    seed = check_int(param, seed, minimum=0)
    if seed > MAX_SEED:
        raise ConfigError(f"{param} must be at most 2**64 - 1 = {MAX_SEED} (torch's generators "
                          f"take a 64-bit seed), got {seed}.")
    return seed


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
    applied.

    Raises:
        ConfigError: naming ``param`` and the folder: weights that cannot be read whole, a
            tensor they do not supply or supply in another shape (:func:`attnscale.hf.
            from_pretrained`), a family that cannot run on attnscale, a model that does not
            read token ids (:func:`check_inspectable`), a tokenizer that cannot be built.
    """
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
        model = hf.from_pretrained(getattr(transformers, auto_class), model_dir, param=param,
                                   local_files_only=True, **extra,
                                   dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    except ConfigError:
        raise
    except (ValueError, KeyError, OSError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"cannot load {param} {str(model_dir)!r}: {first}") from None
    check_inspectable(model, f"{param} {str(model_dir)!r}")
    tokenizer = None
    try:
        if gguf_file is not None:
            if gguf_has_tokenizer(Path(model_dir) / gguf_file):
                tokenizer = transformers.AutoTokenizer.from_pretrained(
                    model_dir, gguf_file=gguf_file, local_files_only=True)
        elif any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir,
                                                                   local_files_only=True)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to build it from the folder's files
        raise ConfigError(f"cannot build the tokenizer of {param} {str(model_dir)!r}"
                          f"{_tokenizer_class(Path(model_dir))}: {_first_line(err)}") from None
    if tokenizer is not None and len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        # transformers builds a class named in tokenizer_config.json without its vocabulary file
        raise ConfigError(f"the tokenizer of {param} {str(model_dir)!r}"
                          f"{_tokenizer_class(Path(model_dir))} holds special tokens only: it was "
                          "built without its vocabulary (that class's vocabulary file is not in "
                          "the folder).")
    if device_map is None:
        model = model.to(device or "cpu")
    return model.eval(), tokenizer


def fresh_model(model: nn.Module, seed: int) -> nn.Module:
    """The same architecture, freshly built and initialised as :func:`reinitialise` initialises
    ``model`` in place under ``seed`` (bit for bit), in the dtype and on the device of ``model``;
    a swapped mechanism is swapped in again, freshly built."""
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
    reinitialise(fresh, seed)
    if swapped is not None:
        hf.set_mechanism(fresh, swapped["name"], **swapped.get("options", {}))
    return fresh.eval()


def _tokenizer_class(folder: Path) -> str:
    """`` (tokenizer_class X in tokenizer_config.json)`` where the folder names one, else ''."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return ""
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return f" (tokenizer_class {name!r} in tokenizer_config.json)" if name else ""


def _first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()),
                type(err).__name__)


def check_inspectable(model: nn.Module, what: str = "model") -> None:
    """Refuse a model inspect cannot measure, before its first pass: one whose attention does
    not run on ``attn_implementation="attnscale"`` (its own or any attention layer's config;
    attnscale observes nothing else), or one that does not read token ids alone (a vision or
    audio model; a model that pairs images with texts, such as CLIP, SigLIP).  ``what``: the
    model as messages name it.  Nothing of the model is changed."""
    from attnscale import hf

    hf.register()  # so that a fresh model of the same architecture can be built on it
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None) or type(model).__name__
    configs = [config] + [getattr(m, "config", None) for m in model.modules()
                          if families.is_attention_layer(m)]
    running = next((c._attn_implementation for c in configs if c is not None and getattr(
        c, "_attn_implementation", hf.ATTN_IMPLEMENTATION) != hf.ATTN_IMPLEMENTATION), None)
    if running is not None:
        raise ConfigError(
            f"{what} runs attn_implementation={running!r}, but inspect observes attention on "
            f"{hf.ATTN_IMPLEMENTATION!r} only: load it with attnscale.hf.from_pretrained("
            "AutoModel, path), or call model.set_attn_implementation('attnscale') after "
            "attnscale.hf.register().")
    reads = getattr(model, "main_input_name", "input_ids")
    if reads != "input_ids":
        raise ConfigError(f"{what}: model family {family!r} reads {reads} (it is not a text "
                          "model), and inspect measures a model on token ids.")
    if _pairs_modalities(config):
        raise ConfigError(f"{what}: model family {family!r} pairs images with texts (its forward "
                          "needs pixel values beside the token ids), and inspect measures a "
                          "model on token ids alone; inspect its text tower saved on its own.")
    vocab_size(model, what)


def _pairs_modalities(config) -> bool:
    """Whether transformers lists the model of ``config`` as one that scores images against
    texts (its zero-shot image classification and object detection models: CLIP, SigLIP,
    ALIGN, OWL-ViT...), whose forward needs both."""
    import transformers

    return any(type(config) in mapping for mapping in (
        transformers.MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING,
        transformers.MODEL_FOR_ZERO_SHOT_OBJECT_DETECTION_MAPPING))


def vocab_size(model: nn.Module, what: str = "model") -> int:
    """The number of token ids ``model`` reads: the rows of its input embeddings."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(f"{what}: model family {family!r} has no token embeddings to read "
                          "token ids with, and inspect measures a model on token ids.")
    return int(weight.shape[0])


def check_input_ids(model: nn.Module, input_ids: object, param: str = "input_ids") -> Tensor:
    """``input_ids`` as a (B, N) integer tensor of ids ``model`` reads (each in [0,
    :func:`vocab_size`)), B, N >= 1."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
            or input_ids.is_complex() or input_ids.dtype == torch.bool or 0 in input_ids.shape:
        shown = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids)
        raise ConfigError(f"{param} must be a (batch, tokens) integer tensor of token ids, got "
                          f"{getattr(input_ids, 'dtype', '')} {shown}.")
    rows = vocab_size(model)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= rows:
        raise ConfigError(f"{param} holds token id {low if low < 0 else high}, outside the "
                          f"model's {rows} token ids [0, {rows - 1}].")
    return input_ids


def model_inputs(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    """The keyword arguments of one forward pass on ``ids``: encoder-decoders read the same
    tokens on both sides."""
    ids = ids.to(next(model.parameters()).device)
    if getattr(model.config, "is_encoder_decoder", False):
        return {"input_ids": ids, "decoder_input_ids": ids}
    return {"input_ids": ids}


def check_seq_len(model: nn.Module, seq_len: int, param: str = "seq_len") -> None:
    """``seq_len`` must fit the model's position table (learned positions index past it), as
    much of it as its family uses (:func:`attnscale.families.max_positions`)."""
    from attnscale.families.table import text_config

    limit = families.max_positions(model.config)
    if limit is not None and seq_len > limit:
        text = text_config(model.config)
        unused = text.max_position_embeddings - limit
        why = "" if not unused else (f", less the first {unused} rows, which {text.model_type} "
                                     "never uses as positions")
        raise ConfigError(f"{param} {seq_len} exceeds the model's maximum of {limit} positions "
                          f"(max_position_embeddings in config.json{why}).")


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
    """Re-initialise ``model`` in place as ``AutoModel.from_config`` initialises a new one, under
    ``torch.manual_seed(seed)`` (the global generator is restored afterwards): each module's own
    ``reset_parameters`` in construction order, then the family's ``_init_weights`` over every
    module, except that a module whose every tensor ``_init_weights`` then writes is not reset
    first.  Its trained weights are overwritten, so one copy of the weights is held; the
    mechanism it runs stays.

    ``from_config`` draws most weights twice, at construction and again in ``_init_weights``;
    drawing only what survives halves the random numbers (0.8 s of 1.7 s on a 135M-parameter
    model on two cores).  The weights are ``from_config``'s in distribution, not in their draw;
    :func:`fresh_model` draws them the same way, so the two agree bit for bit under one seed."""
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)
    devices = [weight.device] if weight is not None and weight.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        _initialise(model, seed)
    return model.eval()


class _Writes(TorchDispatchMode):
    """Records the storage of every tensor an in-place operation would write (the ops whose
    schema marks their first argument written: ``normal_``, ``fill_``, ``copy_``, ...) and skips
    the operation: a dry run of an initialisation."""

    def __init__(self):
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = func._schema.arguments[0] if func._schema.arguments else None
        if (first is not None and first.alias_info is not None and first.alias_info.is_write
                and args and isinstance(args[0], Tensor)):
            self.storages.add(args[0].untyped_storage().data_ptr())
            return args[0]
        return func(*args, **(kwargs or {}))


def _clear_marks(model: nn.Module) -> None:
    """Forget transformers' "already initialised" marks (a load sets them; ``init_weights``
    skips what they mark)."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if "_is_hf_initialized" in tensor.__dict__:
                del tensor._is_hf_initialized


def _initialise(model: nn.Module, seed: int) -> None:
    """:func:`reinitialise`'s draws: a dry run of ``init_weights`` finds the tensors it writes;
    then, under ``seed``, ``reset_parameters`` of every module (in the modules' pre-order) that
    holds a tensor the dry run did not write, and ``init_weights``.  A swapped mechanism is
    built afresh afterwards, as :func:`fresh_model` does."""
    from attnscale import hf

    swapped = getattr(model.config, hf.MECHANISM_ATTR, None)
    if swapped is not None:
        hf.set_mechanism(model, None)
    _clear_marks(model)
    with _Writes() as writes:
        model.init_weights()
    _clear_marks(model)
    torch.manual_seed(seed)
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if module is not model and callable(reset) and any(
                t.untyped_storage().data_ptr() not in writes.storages for t in own):
            reset()
    model.init_weights()
    if swapped is not None:
        hf.set_mechanism(model, swapped["name"], **swapped.get("options", {}))
