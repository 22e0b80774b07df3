"""The ``extend`` experiment: a pretrained checkpoint run past its trained context, training-free,
under one temperature treatment, scored by next-token loss at every position.

One trial is one (extension factor s, treatment, window): the checkpoint (a ``save_pretrained``
folder or a ``.gguf`` file, read by :func:`attnscale.inspect.sources.load_checkpoint`) reads
window ``window`` of the text -- N = s·L tokens, L its trained context -- and the trial records
the mean next-token loss (nats/token) per bucket of positions, over the first L positions (the
model's trained regime), beyond them, and over the whole window.  Windows are consecutive and do
not overlap: window w holds tokens [w(N + 1), (w + 1)(N + 1)) of the text.

Treatments (:func:`parse_treatment`; the canonical text is the grid value):

* ``native``: the model as it is, no RoPE scaling (the positions beyond L are ones it never saw);
* ``hf-yarn``: transformers' own YaRN RoPE scaling, set through the config
  (``rope_parameters = {"rope_type": "yarn", "factor": s, "original_max_position_embeddings":
  L}``; NTK-by-parts frequencies, β_fast 32, β_slow 1), with transformers' default attention
  factor ``yarn_get_mscale(s)`` = 0.1 ln s + 1; ``hf-yarn(attention_factor=a)`` sets it.
  transformers multiplies cos and sin by a, so q and k are each multiplied by a and every logit
  by a².  In the YaRN paper's terms (Peng et al. 2023, arXiv 2309.00071, eq. 22) the logits are
  divided by a temperature t, qᵀk / (t √d), and √(1/t) = 0.1 ln s + 1: a = √(1/t), t = 1/a²;
* a registry mechanism (``logn``, ``ssmax``, ``llama4-temp``, ``mscale``; any mechanism
  :func:`attnscale.hf.set_mechanism` can install), on the same YaRN frequencies with attention
  factor 1, so that the mechanism alone sets the temperature.  Its length option defaults to the
  checkpoint's (``logn(train_len=L)``, ``llama4-temp(floor_scale=L)``, ``mscale(factor=s)``) unless
  the treatment names it, and ``ssmax(s=v)`` sets SSMax's per-head s (a learned parameter, not an
  option), by default 1/ln L (:func:`ssmax_neutral`), at which SSMax's temperature s·ln n is the
  model's own at n = L keys; SSMax's training init 0.43 (``ssmax(s=0.43)``) is the registry's.

Cost: the long forward runs on the ``"attnscale"`` attention implementation, whose causal path is
SDPA's fused kernel with ``is_causal`` (a per-row scale folded into q), so no (B, H, N, N) tensor
is formed; the causal mask transformers asks for is built once per forward as one boolean
(1, 1, N, N) view (N² bytes).  The LM head and the cross-entropy run over :data:`HEAD_CHUNK`
positions at a time, so the (N, vocab) logits never exist in float32 at once.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnscale.errors import ConfigError, check_float, check_int, parse_typed
from attnscale.experiments.lm.data import fingerprint as text_fingerprint
from attnscale.experiments.registry import Param, experiment

# The treatment with no RoPE scaling, and transformers' YaRN RoPE scaling.
NATIVE = "native"
HF_YARN = "hf-yarn"
# transformers' name of the YaRN rope type and of its attention factor (modeling_rope_utils.py).
YARN_ROPE_TYPE = "yarn"
ATTENTION_FACTOR = "attention_factor"
# The length-aware mechanisms the study runs, and the option of each that ties it to the
# checkpoint (filled from L or s unless the treatment names it).
LENGTH_MECHANISMS = ("logn", "ssmax", "llama4-temp", "mscale")
LENGTH_OPTIONS = {"logn": ("train_len", "L"), "llama4-temp": ("floor_scale", "L"),
                  "mscale": ("factor", "s")}
# SSMax's per-head s, set as a treatment option (it is a parameter, not a mechanism option).
SSMAX = "ssmax"
SSMAX_S = "s"
# Positions per bucket of the recorded loss curve.
BUCKET = 256
# Positions per LM-head call: (HEAD_CHUNK, vocab) float32 logits at a time (49152-token vocab:
# 192 MiB), never (N, vocab).
HEAD_CHUNK = 1024
# Bytes per float32.
FLOAT32 = 4


# --- treatments -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Treatment:
    """A temperature treatment: ``native``, ``hf-yarn`` or a registry mechanism, with options."""
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``"native"``, ``"hf-yarn"`` or ``"mechanism"``."""
        return self.name if self.name in (NATIVE, HF_YARN) else "mechanism"

    @property
    def text(self) -> str:
        """The one text of this treatment: ``name`` or ``name(key=value, ...)``, sorted."""
        from attnscale.experiments.lm.trial import format_variant
        return format_variant(self.name, self.options)


def _split(text: str, param: str) -> tuple[str, list[str]]:
    """``"name(a=1, b=2)"`` -> ``("name", ["a=1", "b=2"])``."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{param} must be a treatment name, got {text!r}.")
    name, sep, rest = text.strip().partition("(")
    if sep and not rest.endswith(")"):
        raise ConfigError(f"{param} {text!r} must look like name(key=value, ...).")
    return name.strip(), [p.strip() for p in rest[:-1].split(",") if p.strip()] if sep else []


def parse_treatment(text: str, param: str = "treatment") -> Treatment:
    """A treatment from its text (module doc); an unknown name or option, a repeated option or
    a bad value is a ConfigError naming ``param``."""
    from attnscale.errors import split_key_value
    from attnscale.hf.layers import check_swappable_options
    from attnscale.mechanisms import canonical_options, parse_options
    name, items = _split(text, param)
    if name == NATIVE:
        if items:
            raise ConfigError(f"{param} {text!r}: {NATIVE} takes no options.")
        return Treatment(NATIVE)
    if name == HF_YARN:
        options = {}
        for item in items:
            key, value = split_key_value(f"{param} {text!r}", item)
            if key != ATTENTION_FACTOR:
                raise ConfigError(f"{param} {text!r}: {HF_YARN} takes one option, "
                                  f"{ATTENTION_FACTOR}, got {key!r}.")
            if key in options:
                raise ConfigError(f"{param} {text!r} sets {key!r} more than once.")
            a = parse_typed(f"{param} {key}", value, float)
            if not math.isfinite(a) or a <= 0:
                raise ConfigError(f"{param} {text!r}: {ATTENTION_FACTOR} must be a positive "
                                  f"number, got {value!r}.")
            options[key] = a
        return Treatment(HF_YARN, options)
    strength = {}
    if name == SSMAX:  # s is SSMax's parameter, set after the swap
        rest = []
        for item in items:
            key, value = split_key_value(f"{param} {text!r}", item)
            if key != SSMAX_S:
                rest.append(item)
                continue
            if key in strength:
                raise ConfigError(f"{param} {text!r} sets {key!r} more than once.")
            s = parse_typed(f"{param} {key}", value, float)
            if not math.isfinite(s) or s < 0:
                raise ConfigError(f"{param} {text!r}: {SSMAX_S} must be a number >= 0, got "
                                  f"{value!r}.")
            strength[key] = s
        items = rest
    try:
        options = parse_options(items, name, param=f"{param} {text!r}")
        check_swappable_options(name, options, param)
    except ConfigError as err:
        if name not in _names():
            raise ConfigError(f"{param}: unknown treatment {name!r}; treatments are {NATIVE}, "
                              f"{HF_YARN} and a registry mechanism (e.g. "
                              f"{', '.join(LENGTH_MECHANISMS)}).") from None
        raise err
    return Treatment(name, {**canonical_options(name, options), **strength})


def _names() -> tuple[str, ...]:
    from attnscale.mechanisms import MECHANISMS
    return tuple(MECHANISMS)


def canonical_treatment(text: str, settings: Mapping[str, list] | None = None) -> str:
    """The canonical text of a treatment: ``hf-yarn(attention_factor=1.2)``, ``...=1.20`` and
    ``...=12e-1`` are one."""
    return parse_treatment(text).text


def ssmax_neutral(train_len: int) -> float:
    """SSMax's s at which s·ln n is 1 at n = L keys: 1/ln L (the model's own temperature there)."""
    return 1.0 / math.log(train_len)


# --- the checkpoint ---------------------------------------------------------------------------

def checkpoint_fingerprint(path: str) -> dict:
    """What a checkpoint holds (:func:`attnscale.experiments.lm.data.files_fingerprint`: each
    file's relative name, size and a BLAKE2b hash of its bytes; a ``.gguf`` file, or every file
    of a folder), pinned by the sweep, so a resume on changed weights is refused."""
    from attnscale.experiments.lm.data import files_fingerprint
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"checkpoint {path!r} does not exist.")
    if p.is_file():
        return files_fingerprint(p.parent, [p])
    return files_fingerprint(p, sorted(f for f in p.rglob("*") if f.is_file()))


def text_config(model):
    """The config holding the attention and RoPE settings (a multimodal model's text config)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def trained_length(model, train_len: int | None = None) -> int:
    """L, the trained context: ``train_len`` when given, else the RoPE parameters'
    ``original_max_position_embeddings`` where the config has one, else
    ``max_position_embeddings``."""
    if train_len is not None:
        return train_len
    config = text_config(model)
    rope = getattr(config, "rope_parameters", None) or {}
    original = rope.get("original_max_position_embeddings") if "rope_type" in rope else None
    n = original or getattr(config, "max_position_embeddings", None)
    if not n:
        raise ConfigError("checkpoint: its config gives no trained context "
                          "(max_position_embeddings); pass train_len.")
    return int(n)


def _rope_slot(config) -> tuple[dict, str | None]:
    """The RoPE parameters YaRN replaces, and the layer type they belong to: the config's one
    dict, or, for a config with RoPE per layer type (Gemma 3), the ``full_attention`` layers'
    (the sliding-window layers never see a distance beyond their window)."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or not rope:
        raise ConfigError("checkpoint: its config has no RoPE parameters, so there is no RoPE "
                          "to extend.")
    if "rope_type" in rope:
        return rope, None
    if isinstance(rope.get("full_attention"), dict):
        return rope["full_attention"], "full_attention"
    raise ConfigError(f"checkpoint: RoPE parameters per layer type {sorted(rope)} without "
                      "full_attention layers; attnscale does not know which to extend.")


def yarn_parameters(config, factor: float, train_len: int,
                    attention_factor: float | None) -> dict:
    """The RoPE parameters of transformers' YaRN for extension factor s = ``factor`` of a model
    trained at ``train_len``: the model's own (θ, partial rotary factor) with ``rope_type``
    ``"yarn"``; ``attention_factor`` None leaves transformers' default, 0.1 ln s + 1."""
    rope, _ = _rope_slot(config)
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"checkpoint: its RoPE is already scaled (rope_type "
                          f"{rope['rope_type']!r}); YaRN here extends a plain RoPE.")
    out = {**rope, "rope_type": YARN_ROPE_TYPE, "factor": float(factor),
           "original_max_position_embeddings": int(train_len)}
    if attention_factor is not None:
        out[ATTENTION_FACTOR] = float(attention_factor)
    return out


def set_rope(model, parameters: dict, length: int) -> None:
    """Give ``model`` the RoPE ``parameters`` (its config's, or its full-attention layers') and
    context ``length``, and rebuild every rotary embedding from the config, as transformers
    builds them at load."""
    config = text_config(model)
    _, layer_type = _rope_slot(config)
    if layer_type is None:
        config.rope_parameters = dict(parameters)
    else:
        config.rope_parameters = {**config.rope_parameters, layer_type: dict(parameters)}
    config.max_position_embeddings = int(length)
    rebuilt = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            buffer = next(iter(module.buffers()), None)
            fresh = type(module)(config=module.config)
            if buffer is not None:
                fresh = fresh.to(buffer.device)
            setattr(parent, name.rpartition(".")[2], fresh)
            rebuilt += 1
    if not rebuilt:
        raise ConfigError(f"checkpoint: {type(model).__name__} has no rotary embedding module "
                          "attnscale can rebuild.")


def applied(model, treatment: Treatment, factor: float, train_len: int) -> dict:
    """Apply ``treatment`` for extension factor s = ``factor`` to ``model`` (loaded as it is) and
    return what was set: the RoPE parameters, the attention factor a (logits times a²), and for
    a mechanism its options and SSMax's s."""
    length = round(factor * train_len)
    out: dict[str, Any] = {"rope_type": "default", ATTENTION_FACTOR: 1.0}
    if treatment.kind == NATIVE:
        return out
    a = treatment.options.get(ATTENTION_FACTOR) if treatment.kind == HF_YARN else 1.0
    parameters = yarn_parameters(text_config(model), factor, train_len, a)
    set_rope(model, parameters, length)
    scaling = {m.attention_scaling for m in model.modules() if hasattr(m, "attention_scaling")}
    out = {"rope_type": YARN_ROPE_TYPE, ATTENTION_FACTOR: float(max(scaling))}
    if treatment.kind == "mechanism":
        from attnscale.hf import set_mechanism
        options = {k: v for k, v in treatment.options.items()
                   if not (treatment.name == SSMAX and k == SSMAX_S)}
        tied = LENGTH_OPTIONS.get(treatment.name)
        if tied is not None and tied[0] not in options:
            options[tied[0]] = (train_len if tied[1] == "L" else float(factor))
            from attnscale.mechanisms import canonical_options
            options = canonical_options(treatment.name, options)
        set_mechanism(model, treatment.name, **options)
        out["mechanism"] = {"name": treatment.name, "options": options}
        if treatment.name == SSMAX:
            s = treatment.options.get(SSMAX_S, ssmax_neutral(train_len))
            _set_ssmax(model, s)
            out["mechanism"]["s"] = s
    return out


def _set_ssmax(model, s: float) -> None:
    import torch
    from attnscale.hf import MECHANISM_ATTR
    with torch.no_grad():
        for module in model.modules():
            mechanism = getattr(module, MECHANISM_ATTR, None)
            if mechanism is not None:
                mechanism.s.fill_(s)


# --- the loss ---------------------------------------------------------------------------------

def position_losses(model, ids, *, chunk: int = HEAD_CHUNK):
    """Next-token loss (nats) at every position of ``ids`` (1, N + 1) int64: (N,) float64, the
    loss of predicting token i + 1 from tokens 0..i.  The decoder runs once over the N inputs;
    the LM head (and a final soft-cap, as Gemma's ``final_logit_softcapping``) and the
    cross-entropy run ``chunk`` positions at a time."""
    import torch
    import torch.nn.functional as F
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    head = model.get_output_embeddings()
    cap = getattr(text_config(model), "final_logit_softcapping", None)
    inputs, targets = ids[:, :-1], ids[0, 1:]
    with torch.no_grad():
        hidden = decoder(input_ids=inputs, use_cache=False).last_hidden_state[0]   # (N, d)
        out = torch.empty(targets.shape[0], dtype=torch.float64)
        for lo in range(0, targets.shape[0], chunk):
            logits = head(hidden[lo:lo + chunk]).float()                         # (c, vocab)
            if cap:
                logits = torch.tanh(logits / cap) * cap
            out[lo:lo + chunk] = F.cross_entropy(logits, targets[lo:lo + chunk],
                                                 reduction="none").double()
    return out


def bucket_means(losses, bucket: int) -> list[float]:
    """Mean of ``losses`` (N,) over consecutive buckets of ``bucket`` positions (the last one
    may be shorter)."""
    return [float(losses[lo:lo + bucket].mean()) for lo in range(0, len(losses), bucket)]


def window_ids(tokenizer, text: str | None, length: int, window: int, vocab_size: int):
    """Tokens [w(N + 1), (w + 1)(N + 1)) of the text (the default text when None), N =
    ``length``: ``(ids (1, N + 1), source in words)``."""
    from attnscale.inspect.inputs import read_text, token_ids
    if tokenizer is None:
        raise ConfigError("checkpoint has no tokenizer, so it cannot read a text; a loss on "
                          "random ids says nothing about its context.")
    body = None if text is None else read_text(text, param="text")
    need = (window + 1) * (length + 1)
    got = token_ids(tokenizer, body, need, vocab_size=vocab_size, text_param="text",
                    seq_len_param=f"the tokens windows 0-{window} of {length + 1} need,")
    return got.ids[:, window * (length + 1):], got.source


class PeakRSS:
    """The peak resident memory of this process over a block: Linux's VmHWM, reset on entry by
    writing 5 to /proc/self/clear_refs; where that is refused, the process's peak so far
    (``exact`` False)."""

    def __enter__(self) -> PeakRSS:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.exact = True
        except OSError:
            self.exact = False
        self.before = _status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.peak = _status("VmHWM")


def _status(key: str) -> int | None:
    """A /proc/self/status field in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def forward_memory(model, length: int, vocab_size: int) -> int:
    """An upper estimate of one forward's working set beyond the weights (bytes): the causal
    mask (N² bytes), a few (N, d_model) and (N, d_ff) float32 activations, q, k and v with the
    key and value heads repeated, and one LM-head chunk of logits."""
    config = text_config(model)
    d = int(config.hidden_size)
    d_ff = int(getattr(config, "intermediate_size", 4 * d) or 4 * d)
    heads = int(config.num_attention_heads)
    d_head = int(getattr(config, "head_dim", None) or d // heads)
    activations = length * (6 * d + 3 * d_ff + 4 * heads * d_head) * FLOAT32
    return length * length + activations + 3 * HEAD_CHUNK * vocab_size * FLOAT32


# --- the experiment ---------------------------------------------------------------------------

def _params() -> dict[str, Param]:
    return {
        "checkpoint": Param(str, path=True, fingerprint=checkpoint_fingerprint),
        "factor": Param(float, 2.0),                  # s: the window is s·L tokens
        "treatment": Param(str, HF_YARN, canonical=canonical_treatment),
        "window": Param(int, 0),                      # which non-overlapping window of the text
        # the text: a UTF-8 file, pinned by its fingerprint; None: text that ships with Python
        "text": Param(str, None, optional=True, path=True, fingerprint=text_fingerprint),
        "train_len": Param(int, None, optional=True),  # L; None: read from the config
        "bucket": Param(int, BUCKET),                 # positions per recorded loss bucket
        "dtype": Param(str, "auto"),                  # the weights' dtype, as inspect loads them
    }


def check(config: dict) -> None:
    """Every value of a trial config, before any trial runs (one-line errors naming them)."""
    from attnscale.inspect.inputs import DTYPES
    from attnscale.errors import check_choice
    factor = check_float("factor", config["factor"], positive=True)
    if not factor > 1:
        raise ConfigError(f"factor must be > 1 (s: the window is s times the trained context), "
                          f"got {config['factor']!r}.")
    check_int("window", config["window"], minimum=0)
    check_int("bucket", config["bucket"], minimum=1)
    if config["train_len"] is not None:
        check_int("train_len", config["train_len"], minimum=2)
    check_choice("dtype", config["dtype"], DTYPES)
    parse_treatment(config["treatment"])
    _check_checkpoint(config["checkpoint"])


# Checkpoints already checked, by (path, size, modification time): checking a GGUF reads its
# header and every tensor's extent (16 s for SmolLM2's on a loaded 2-core machine), and a sweep
# checks every trial's config.
_CHECKED: set[tuple] = set()


def _check_checkpoint(path: str) -> None:
    """The checkpoint as ``attnscale inspect`` checks it (a whole GGUF, or a model folder), not a
    run folder; checked once per process and version of the file."""
    from attnscale.inspect.sources import resolve
    p = Path(path)
    key = (path, p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else None
    if key is not None and key in _CHECKED:
        return
    if resolve([path], param="checkpoint")[0].is_run:
        raise ConfigError(f"checkpoint {path!r} is a run folder; pass one of its checkpoints.")
    _CHECKED.add(key)


@experiment("extend", params=_params(), check=check, threads=None)
def extend_trial(*, checkpoint: str, factor: float, treatment: str, window: int,
                 text: str | None, train_len: int | None, bucket: int, dtype: str) -> dict:
    """Evaluate ``checkpoint`` on window ``window`` of s·L tokens under ``treatment``."""
    import torch
    from attnscale.memory import check_memory
    how = parse_treatment(treatment)
    model, tokenizer = loaded(checkpoint, dtype)
    L = trained_length(model, train_len)
    n = round(factor * L)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    check_memory(f"a forward of {n} tokens", forward_memory(model, n, vocab),
                 hint="use a smaller factor")
    key = (checkpoint, dtype, text, n, window)
    if key not in _WINDOWS:
        _WINDOWS.clear()
        _WINDOWS[key] = window_ids(tokenizer, text, n, window, vocab)
    ids, source = _WINDOWS[key]
    setting = applied(model, how, factor, L)
    load = os.getloadavg()
    with PeakRSS() as peak:
        start = time.perf_counter()
        losses = position_losses(model, ids)
        seconds = time.perf_counter() - start
    return {
        "model": type(model).__name__, "train_len": L, "length": n, "treatment": how.text,
        "applied": setting, "attention_factor": setting[ATTENTION_FACTOR],
        "text_source": source,
        "tokens_blake2b": hashlib.blake2b(ids.numpy().tobytes(), digest_size=8).hexdigest(),
        "bucket": bucket, "loss_by_bucket": bucket_means(losses, bucket),
        "loss": float(losses.mean()), "loss_trained": float(losses[:L].mean()),
        "loss_beyond": float(losses[L:].mean()),
        "forward_seconds": seconds, "peak_rss_bytes": peak.peak, "rss_bytes_before": peak.before,
        "peak_exact": peak.exact, "threads": torch.get_num_threads(),
        "loadavg_before": list(load), "loadavg_after": list(os.getloadavg()),
    }


# The checkpoint as loaded, kept by the worker process between its trials (loading and
# dequantising a GGUF and building its tokenizer take a minute on 2 cores): (path, dtype, its
# fingerprint) -> (model, tokenizer).  Every trial runs on a deep copy, so no treatment leaks
# into the next.  Likewise the last window's token ids.
_LOADED: dict[tuple, tuple] = {}
_WINDOWS: dict[tuple, tuple] = {}


def loaded(checkpoint: str, dtype: str):
    """A fresh copy of ``(model, tokenizer)`` of the checkpoint (:func:`_load`), loaded once per
    process and version of its files."""
    import copy
    key = (checkpoint, dtype, repr(checkpoint_fingerprint(checkpoint)))
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = _load(checkpoint, dtype)
    model, tokenizer = _LOADED[key]
    return copy.deepcopy(model), tokenizer


def _load(checkpoint: str, dtype: str):
    """``(model with its LM head, tokenizer)``, as ``attnscale inspect`` reads the checkpoint
    (attention implementation ``"attnscale"``, eval mode)."""
    from attnscale.inspect.sources import load_checkpoint
    return load_checkpoint(checkpoint, dtype=dtype, lm_head=True, param="checkpoint")
