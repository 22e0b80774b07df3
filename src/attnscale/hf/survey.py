"""The family sweep: every model type of the installed transformers, built tiny from its config,
run on token ids with ``attn_implementation="attnscale"`` against HF's own ``"eager"``.

For each model type (:func:`check_family`): the default config is shrunk (:func:`tiny_config`:
a few layers of 32 channels, every distinct ``layer_types`` entry once, special token ids moved
to the top of a small vocabulary, dropout off), the model is built in float32 with the weights of
its attention layers enlarged (x :data:`ENLARGE`, so attention is far from uniform; the table
gives each family's mean largest weight), and one unpadded and one left-padded batch of token ids
run on ``"eager"``, ``"sdpa"`` and ``"attnscale"`` with the same weights.  Then:

* **outputs**: every floating output at the real positions (padded queries are undefined) must
  equal eager's to :data:`TOLERANCE` x the largest output; otherwise the family is *wrong*.  Where
  HF's own eager and sdpa disagree by more than that, the row says so (attnscale follows eager).
* **monitor**: :func:`attnscale.monitor` must record every attention call the forward made.
* **swap**: :func:`attnscale.hf.set_mechanism` with ``qk-rmsnorm`` changes every attention layer
  and the model runs, or it is refused with its one-line reason.
* **clip**: strict QK-Clip (:func:`attnscale.guard`, τ half the largest logit) leaves every
  head's largest logit on the batch at most τ, measured independently from the q and k each
  layer hands its attention function, or it is refused with its one-line reason.

``python -m attnscale.hf.survey --out docs/families.md`` writes the supported-families table
(:func:`render`); the test suite checks every row of the committed table against a fresh sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field

import torch
import transformers
from torch import Tensor, nn

from attnscale.errors import ConfigError
from attnscale.families import facts, is_attention_layer
from attnscale.hf.attention import (
    ATTN_IMPLEMENTATION, attnscale_attention_forward, attnscale_mask, register,
)
from attnscale.hf.layers import set_mechanism

# The sweep's tiny sizes: every config attribute of these names (in the config and its
# sub-configs) is set to at most this value.  Heads of 8 channels, 4 query and 2 key heads.
TINY = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "embedding_size": 32,
    "hidden_dim": 32, "dim": 32, "decoder_hidden_size": 32, "encoder_hidden_size": 32,
    "text_hidden_size": 32, "projection_dim": 16, "intermediate_size": 64, "ffn_dim": 64,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_ff": 64, "n_inner": 64, "mlp_dim": 64,
    "decoder_intermediate_size": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_attention_heads": 4, "n_head": 4,
    "num_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "n_heads": 4,
    "decoder_num_attention_heads": 4, "attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "d_kv": 8, "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2,
    "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
    "num_encoder_layers": 2, "depth": 2, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_num_experts": 4,
    "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "qk_head_dim": 12, "first_k_dense_replace": 1,
    "sliding_window": 6, "index_head_dim": 8, "index_n_heads": 2, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "max_position_embeddings": 256, "vocab_size": 96, "rotary_dim": 4, "moe_k": 2,
    # tables and towers that would dominate the build: entity and hash vocabularies, per-layer
    # inputs, codebooks
    "entity_vocab_size": 64, "encoder_hash_byte_group_vocab": 64,
    "vocab_size_per_layer_input": 96, "hidden_size_per_layer_input": 8, "codebook_size": 64,
    "base_channels": 32, "hidden_size_global": 32, "entity_emb_size": 32, "num_filters": 4,
    "linear_head_dim": 8, "linear_num_heads": 4, "num_experts_per_token": 2, "n_group": 1,
    "topk_group": 1, "num_expert_group": 1,
}
# Per-stage block counts of convolutional towers (audio tokenizers): one block per stage.
STAGES = ("depths",)
# Attributes set to exactly these values (a size whose default is smaller still changes).
EXACT = ("head_dim",)
# Attributes whose default None the model derives from sizes the sweep shrinks: set them too.
DERIVED = ("head_dim", "vocab_size", "num_experts_per_tok")
# Token ids a model reads although its default config leaves them None (ESM's padding and
# mask): set to ids at the top of the vocabulary, which random input never draws.
NONE_TOKENS = ("pad_token_id", "mask_token_id")
# The counts of layers, set to the number of distinct layer types where a config lists them.
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
                "decoder_layers", "num_decoder_layers", "num_encoder_layers")
# Tokens per sequence and the left padding of the second sequence of the padded batch.
SEQ, PAD = 12, 4
# The matrices of attention layers are drawn with std ENLARGE / sqrt(fan-in) after init: q and k
# coordinates of about ENLARGE on normalised inputs, logits of several units, attention far
# from uniform (the monitor's mean largest weight is in the table's sweep records).
ENLARGE = 1.5
# Outputs equal eager's when max |attnscale - eager| <= TOLERANCE * max |eager| (float32).
TOLERANCE = 1e-4
# The swap the sweep tries: a mechanism with learned gains, which normalises q and k.
SWAP = "qk-rmsnorm"
# The implementation the sweep's clip check measures through: attnscale's, recording q and k.
CAPTURE = "attnscale-survey-capture"


class NotBuilt(Exception):
    """The model type cannot be built tiny, or takes no token ids (``reason``)."""


@dataclass
class FamilyResult:
    """One row of the sweep (see the module doc)."""
    model_type: str
    status: str                 # "exact", "wrong", "refused", or why it was not checked
    reason: str = ""            # for a status other than exact: the one-line reason
    families: tuple[str, ...] = ()  # the families (layer model types) of its attention layers
    layers: int = 0             # attention layers the forward called
    diff: float = math.nan      # max |attnscale - eager| / max |eager|, padded and not
    split: float = math.nan     # max |sdpa - eager| / max |eager|: HF's own split
    max_weight: float = math.nan  # mean largest attention weight (1/N: uniform, 1: one-hot)
    monitor: str = ""           # "all" or what it missed
    swap: str = ""              # "whole" or the refusal
    clip: str = ""              # "bounded" or the refusal
    extra: dict = field(default_factory=dict)

    def row(self) -> tuple[str, ...]:
        """The columns of the table in docs/families.md."""
        if self.status not in ("exact", "wrong"):
            return (self.model_type, self.status, self.reason, "", "", "", "")
        outputs = "exact" if self.status == "exact" else f"**wrong** ({self.diff:.1e})"
        if not math.isnan(self.split) and self.split > TOLERANCE:
            outputs += " (eager ≠ sdpa)"
        return (self.model_type, outputs, ", ".join(self.families), str(self.layers),
                self.monitor, self.swap, self.clip)


def _special_ids(config, found: set[int]) -> None:
    for key, value in vars(config).items():
        if isinstance(value, transformers.PretrainedConfig):
            _special_ids(value, found)
        elif key.endswith(("_token_id", "_token_index")) and isinstance(value, int) \
                and not isinstance(value, bool) and value >= 0:
            found.add(value)


def _shrunk(config, ids: dict[int, int]) -> dict:
    """The keyword arguments of a tiny version of ``config`` (sub-configs as dicts)."""
    out = {}
    for key, value in vars(config).items():
        if key.startswith("_") or isinstance(getattr(type(config), key, None), property):
            continue
        if isinstance(value, transformers.PretrainedConfig):
            out[key] = _shrunk(value, ids)
        elif key in STAGES and isinstance(value, (list, tuple)) and \
                all(isinstance(x, int) for x in value):
            out[key] = type(value)(min(1, x) for x in value)
        elif isinstance(value, dict) and any(k in TINY for k in value):  # a sub-config dict
            out[key] = {k: (min(v, TINY[k]) if k in TINY and isinstance(v, int)
                            and not isinstance(v, bool) else v) for k, v in value.items()}
        elif value is None and key in DERIVED:  # derived by the model: set it, with the rest
            out[key] = TINY[key]
        elif isinstance(value, bool) or value is None:
            continue
        elif key in TINY and isinstance(value, int):
            out[key] = TINY[key] if key in EXACT else min(value, TINY[key])
        elif key.endswith(("_token_id", "_token_index")) and isinstance(value, int):
            out[key] = ids.get(value, value)
        elif ("dropout" in key or key.endswith(("_prob", "pdrop"))) and isinstance(value, float):
            out[key] = 0.0
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and types and \
            not isinstance(getattr(type(config), "layer_types", None), property):
        distinct = list(dict.fromkeys(types))
        out["layer_types"] = distinct if len(distinct) > 1 else list(types[:2])
        for key in LAYER_COUNTS:
            if key in out:
                out[key] = len(out["layer_types"])
    n = len(out.get("layer_types", ())) or 2
    for key in ("num_attention_heads_per_layer", "mlp_layer_types", "no_rope_layers"):
        value = getattr(config, key, None)
        if isinstance(value, list) and value:
            out[key] = [TINY["num_attention_heads"]] * n if key.endswith("per_layer") \
                else (value * n)[:n]
    if "kv_lora_rank" in out:  # latent attention: a key per head, head_dim is RoPE's
        if "num_key_value_heads" in out and "num_attention_heads" in out:
            out["num_key_value_heads"] = out["num_attention_heads"]
        if "qk_rope_head_dim" in out and "head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]
        if "qk_head_dim" in out:
            out["qk_head_dim"] = out.get("qk_nope_head_dim", 0) + out.get("qk_rope_head_dim", 0)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        # multimodal RoPE: its sections split the rotated half of the (tiny) head
        sections = rope["mrope_section"]
        half = out.get("head_dim", TINY["head_dim"]) // 2
        small = [max(1, half * x // sum(sections)) for x in sections]
        small[-1] += half - sum(small)
        out["rope_parameters"] = {**rope, "mrope_section": small}
    if "vocab_size" in out:
        taken = set(ids.values())
        free_top = [i for i in range(TINY["vocab_size"] - 1, -1, -1) if i not in taken]
        for key in NONE_TOKENS:
            if key in vars(config) and getattr(config, key) is None:
                out[key] = free_top.pop(0)
        out["vocab_size"] = max(out["vocab_size"], max(ids.values(), default=-1) + 1)
    return out


def tiny_config(model_type: str):
    """A tiny config of ``model_type`` (module doc); special token ids are moved to the top of a
    vocabulary of :data:`TINY` ``["vocab_size"]`` ids (the rest are free for random input).

    Raises:
        NotBuilt: the default config cannot be made, or rejects the tiny sizes.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
        base = cls()
        found: set[int] = set()
        _special_ids(base, found)
        top = TINY["vocab_size"]
        ids = {old: top - 1 - i for i, old in enumerate(sorted(found))}
        return cls(**_shrunk(base, ids))
    except Exception as err:  # any failure of a foreign config is a reason, not a crash
        raise NotBuilt(f"config: {_first_line(err)}") from None


# Where Python put a module says nothing about a family and differs between checkouts: a module's
# repr loses its file, and a path keeps only what follows site-packages.
_MODULE_FILE = re.compile(r"(<module '[^']*') from '[^']*'")
_SITE = re.compile(r"/\S*?/site-packages/")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    line = _SITE.sub("", _MODULE_FILE.sub(r"\1", text[0])) if text else ""
    if len(line) > 120:
        line = line[:117] + "..."
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


def _free_ids(config) -> int:
    """The number of token ids below every special id (random input draws from them)."""
    found: set[int] = set()
    _special_ids(config, found)
    vocab = getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", None) or TINY["vocab_size"]
    return max(2, min([vocab, *found]))


def _base_class(config_class: type) -> type | None:
    """The base model of a config AutoModel does not map (a tower of a composite model:
    ``clip_text_model``...): the class of its modeling module declaring it as its config
    (``config_class``), without a task head ("For...") -- None if there is none."""
    import importlib

    module = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        modeling = importlib.import_module(module)
    except ImportError:
        return None
    found = [c for c in vars(modeling).values()
             if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)
             and getattr(c, "config_class", None) is config_class and "For" not in c.__name__
             and not c.__name__.endswith("PreTrainedModel")]
    return found[0] if found else None


def build(model_type: str, seed: int = 0) -> tuple[nn.Module, dict, dict]:
    """The tiny float32 model of ``model_type`` (eval mode, attention weights enlarged) and its
    unpadded and padded batches.

    Raises:
        NotBuilt: with the reason (config, build, no token ids, no attention layer).
    """
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    config = tiny_config(model_type)
    try:
        cls = MODEL_MAPPING.get(type(config), None) or _base_class(type(config))
        if isinstance(cls, (tuple, list)):  # several base classes: the first is AutoModel's
            cls = cls[0]
        params = None if cls is None else inspect.signature(cls.forward).parameters
    except Exception as err:  # the class's optional dependency is missing (timm, ...)
        raise NotBuilt(f"model class: {_first_line(err)}") from None
    if cls is None:
        raise NotBuilt("no base model class (AutoModel) for this config")
    if "input_ids" not in params:
        raise NotBuilt("takes no token ids")
    try:
        torch.manual_seed(seed)
        model = cls._from_config(config, attn_implementation="eager",
                                 dtype=torch.float32).eval()
    except Exception as err:
        raise NotBuilt(f"build: {_first_line(err)}") from None
    layers = [m for m in model.modules() if is_attention_layer(m)]
    if not layers:
        raise NotBuilt("no attention layer goes through the AttentionInterface")
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for layer in layers:  # matrices of std ENLARGE / sqrt(fan-in): logits of several units
            for p in layer.parameters(recurse=True):
                if p.dim() >= 2 and p.is_floating_point():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype)
                            * (ENLARGE / p.shape[-1] ** 0.5))
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, _free_ids(config), (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :PAD] = 0
    plain, padded = {"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        for batch in (plain, padded):
            batch["decoder_input_ids"] = ids
    return model, plain, padded


def _outputs(model: nn.Module, batch: dict) -> list[Tensor]:
    """The floating outputs of a forward; with padding, those per position (B, N, ...) alone,
    padded positions zeroed."""
    with torch.no_grad():
        out = model(**batch)
    mask = batch.get("attention_mask")
    tensors = []

    def walk(x):
        if isinstance(x, Tensor):
            if x.is_floating_point():
                tensors.append(x)
        elif isinstance(x, dict) or hasattr(x, "to_tuple"):
            for v in (x.values() if isinstance(x, dict) else x.to_tuple()):
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(out)
    if mask is not None:
        # Padded queries attend no key: their outputs are undefined (eager averages every
        # value there, SDPA and attnscale give 0), and so is any output read from them (a
        # pooled "last token" that is padding): only outputs per position are compared,
        # at the real positions.
        real = mask.bool()
        tensors = [t.masked_fill(~real.view(*real.shape, *[1] * (t.dim() - 2)), 0.0)
                   for t in tensors if t.dim() >= 2 and t.shape[:2] == real.shape]
    return tensors


def _relative(got: list[Tensor], want: list[Tensor]) -> float:
    """max |got - want| / max |want| over matching outputs (inf if they do not match up)."""
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return math.inf
    scale = max((float(w.abs().max()) for w in want if w.numel()), default=0.0) or 1.0
    diff = max((float((g - w).abs().nan_to_num(math.inf).max()) for g, w in zip(got, want)
                if g.numel()), default=0.0)
    return diff / scale


@contextlib.contextmanager
def _quiet():
    """transformers' logging and warnings off, and the Hub offline: a default config that names
    a pretrained backbone must fail to build, never download it."""
    import huggingface_hub.constants as hub

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    offline, env = hub.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    hub.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            transformers.logging.set_verbosity(verbosity)
            hub.HF_HUB_OFFLINE = offline
            if env is None:
                os.environ.pop("HF_HUB_OFFLINE", None)
            else:
                os.environ["HF_HUB_OFFLINE"] = env


def check_family(model_type: str, *, implementation: str = ATTN_IMPLEMENTATION,
                 checks: tuple[str, ...] = ("monitor", "swap", "clip")) -> FamilyResult:
    """Sweep one model type (module doc).  ``implementation``: the attention implementation
    compared with eager (a deliberately wrong one, registered by a test, must come out
    ``"wrong"``); ``checks``: which of the monitor, swap and clip checks to run."""
    register()
    with _quiet():
        try:
            model, plain, padded = build(model_type)
        except NotBuilt as why:
            return FamilyResult(model_type, "not built", str(why))
        result = FamilyResult(model_type, "exact")
        try:
            eager = [_outputs(model, b) for b in (plain, padded)]
        except Exception as err:  # the tiny model does not run on HF's own eager path
            return FamilyResult(model_type, "not built", f"eager: {_first_line(err)}")
        try:
            model.set_attn_implementation("sdpa")
            sdpa = [_outputs(model, b) for b in (plain, padded)]
            result.split = max(_relative(s, e) for s, e in zip(sdpa, eager))
        except Exception:  # HF's sdpa refuses the family: no split to report
            result.split = math.nan
        try:
            model.set_attn_implementation(implementation)
            ours = [_outputs(model, b) for b in (plain, padded)]
        except ConfigError as err:
            return FamilyResult(model_type, "refused", str(err))
        except Exception as err:
            return FamilyResult(model_type, "error", f"attnscale: {_first_line(err)}")
        result.diff = max(_relative(o, e) for o, e in zip(ours, eager))
        if not result.diff <= TOLERANCE:
            result.status = "wrong"
            result.reason = f"outputs differ from eager by {result.diff:.2e} of their scale"
        result.extra["bypassing"] = _bypassing_candidates(model)
        names, calls = _called_layers(model, plain)
        result.extra["called"] = names
        result.layers = len(names)
        result.families = tuple(sorted({str(getattr(getattr(m, "config", None), "model_type",
                                                     "")) for m in calls}))
        for name, check, attr in (("monitor", _check_monitor, "monitor"),
                                  ("swap", _check_swap, "swap"), ("clip", _check_clip, "clip")):
            if name in checks:
                try:
                    check(model, plain, result)
                except Exception as err:  # a bug of attnscale's: the row says so
                    setattr(result, attr, f"error: {_first_line(err)}")
        return result


def _bypassing_candidates(model: nn.Module) -> list[str]:
    """Classes of modules that look like attention forming its own softmax: "Attention" in the
    class name, a forward that calls softmax or SDPA and not the interface, not inside an
    interface layer.  The table must list each (``own_attention``); the sweep test checks it."""
    inside: set[int] = set()
    found = []
    for m in model.modules():
        if is_attention_layer(m):
            inside.update(id(sub) for sub in m.modules())
    for m in model.modules():
        code = getattr(inspect.unwrap(type(m).forward), "__code__", None)
        if id(m) in inside or code is None or "Attention" not in type(m).__name__:
            continue
        names = set(code.co_names)
        if names & {"softmax", "scaled_dot_product_attention"}:
            found.append(type(m).__name__)
    return sorted(set(found))


def _called_layers(model: nn.Module, batch: dict) -> tuple[list[str], list[nn.Module]]:
    """Qualified names and modules of the attention layers a forward calls, in call order."""
    names, modules, handles = [], [], []
    for name, m in model.named_modules():
        if is_attention_layer(m):
            def hook(mod, args, name=name):
                if name not in names:  # a shared layer (ALBERT, HRM) is one layer
                    names.append(name)
                    modules.append(mod)
            handles.append(m.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return names, modules


def _check_monitor(model, batch, result) -> None:
    from attnscale.measure.monitor import monitor

    names = result.extra["called"]
    with torch.no_grad(), monitor(model) as mon:
        model(**batch)
    recorded = list(dict.fromkeys(r["module"] for r in mon.records))
    # A layer calling attention twice in one forward (DiffLlama) is recorded once per call
    # (name, name#1); one called twice (a shared layer) merges its calls under its name.
    missing = [n for n in names if n not in recorded]
    result.monitor = "all" if not missing else f"missed {len(missing)}: {missing[0]}"
    # The family table's head count, read off the projections, is the call's.
    modules = dict(model.named_modules())
    for name in recorded:
        try:
            f = facts(modules[name.split("#")[0]])
        except ConfigError:
            continue
        heads = sum(r["module"] == name for r in mon.records)
        if f.n_heads is not None and f.n_heads != heads:
            result.monitor = f"{name}: the table reads {f.n_heads} heads, the call has {heads}"
            return
    if mon.records:
        result.max_weight = sum(r["max_weight_mean"] for r in mon.records) / len(mon.records)


def _check_swap(model, batch, result) -> None:
    try:
        changed = set_mechanism(model, SWAP)
    except ConfigError as err:
        result.swap = f"refused: {err}"
        return
    try:
        with torch.no_grad():
            model(**batch)
        layers = [m for m in model.modules() if is_attention_layer(m)]
        result.swap = "whole" if len(changed) == len(layers) else \
            f"partial: {len(changed)} of {len(layers)}"
    except Exception as err:
        result.swap = f"error: {_first_line(err)}"
    finally:
        set_mechanism(model, None)


_CAPTURED: list | None = None


def _capture_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """attnscale's attention, recording each call's largest logit per head (before any cap
    and position bias, over the keys the call attends: the logit the guard clips)."""
    if _CAPTURED is not None:
        from attnscale.hf.attention import head_logit_peaks

        _CAPTURED.append(head_logit_peaks(query, key, attention_mask, scaling))
    return attnscale_attention_forward(module, query, key, value, attention_mask,
                                       scaling=scaling, **kwargs)


def largest_logit(model: nn.Module, batch: dict) -> float:
    """The largest pre-softmax logit (before any cap and any position bias) of any head of
    any attention layer of ``model`` on ``batch``, over the keys each query attends: measured in
    eval mode from the q and k each layer hands its attention function, which runs on
    ``"attnscale"`` (afterwards too)."""
    global _CAPTURED
    _install_capture()
    _CAPTURED = []
    training = model.training
    try:
        model.set_attn_implementation(CAPTURE)
        model.eval()
        with torch.no_grad():
            model(**batch)
        peaks = _CAPTURED
    finally:
        _CAPTURED = None
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        model.train(training)
    return max((float(p.max()) for p in peaks if p.numel()), default=-math.inf)


def _install_capture() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAPTURE, _capture_forward)
    AttentionMaskInterface.register(CAPTURE, attnscale_mask)


def _check_clip(model, batch, result) -> None:
    from attnscale.guard import guard

    from attnscale.guard import clip_sites

    try:
        clip_sites(model)  # a refusal says why before anything is measured
    except ConfigError as err:
        result.clip = f"refused: {err}"
        return
    before = largest_logit(model, batch)
    if not before > 0:
        result.clip = "no positive logit"
        return
    tau = before / 2
    try:
        with guard(model, qk_clip=tau, strict=True, every=1, alarm_logit=None) as g:
            model.train()
            model(**batch)
            g.step(0)
    except ConfigError as err:
        result.clip = f"refused: {err}"
        return
    except Exception as err:
        result.clip = f"error: {_first_line(err)}"
        return
    finally:
        model.eval()
    after = largest_logit(model, batch)
    result.extra["clip"] = (tau, after)
    result.clip = "bounded" if after <= tau * (1 + 1e-4) else f"over τ: {after / tau:.4f} τ"


def model_types() -> list[str]:
    """Every model type of the installed transformers, sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


# The columns of docs/families.md, for the rows of families that ran.
COLUMNS = ("model type", "outputs vs eager", "attention families", "layers", "monitor",
           "set_mechanism", "QK-Clip")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(results: list[FamilyResult]) -> str:
    """docs/families.md: the counts, then one row per model type that ran, then the model types
    the sweep could not check, each with its reason."""
    ran = [r for r in results if r.status in ("exact", "wrong", "refused", "error")]
    skipped = [r for r in results if r not in ran]
    counts = _counts(results)
    lines = [
        "# Hugging Face families",
        "",
        "Generated by `python -m attnscale.hf.survey --out docs/families.md` (the family sweep, "
        f"`attnscale.hf.survey`) on transformers {transformers.__version__}; "
        "`tests/test_hf_families.py` checks every row against a fresh sweep.",
        "",
        "Each model type is built tiny from its default config (random weights, the attention "
        f"layers' matrices drawn with std {ENLARGE:g}/√fan-in so attention is far from uniform) "
        "and run on token ids, "
        "one batch unpadded and one left-padded, with `attn_implementation=\"attnscale\"` and "
        "with HF's own `\"eager\"` on the same weights.  *exact*: every output equals eager's "
        f"to {TOLERANCE:g} of its scale; *eager ≠ sdpa*: HF's own `\"sdpa\"` differs from its "
        "`\"eager\"` there (attnscale follows eager).  *monitor*: `attnscale.monitor` recorded "
        f"every attention call.  *set_mechanism*: `set_mechanism(model, \"{SWAP}\")` changed "
        "every attention layer (*whole*), or was refused with the reason shown.  *QK-Clip*: the "
        "guard's strict clip at τ = half the largest logit left every head at or below τ "
        "(*bounded*), or was refused with the reason shown.",
        "",
        "| count | model types |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in counts.items()),
        "",
        "## Families that run",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in ran:
        lines.append("| " + " | ".join(_cell(c) for c in r.row()) + " |")
    lines += ["", "## Model types not checked", "",
              "| model type | why |", "|---|---|"]
    for r in skipped:
        lines.append(f"| {r.model_type} | {_cell(r.status + ': ' + r.reason)} |")
    return "\n".join(lines) + "\n"


def _counts(results: list[FamilyResult]) -> dict[str, int]:
    """Built, recognised, exact, refused (by reason), wrong: the sweep's summary."""
    ran = [r for r in results if r.status in ("exact", "wrong", "refused", "error")]
    out = {"model types": len(results),
           "built and run on token ids": len(ran),
           "exact (outputs equal eager's)": sum(r.status == "exact" for r in ran),
           "wrong (outputs differ from eager's)": sum(r.status == "wrong" for r in ran),
           "refused by attnscale": sum(r.status == "refused" for r in ran),
           "errors under attnscale": sum(r.status == "error" for r in ran),
           "eager ≠ sdpa in HF itself": sum(not math.isnan(r.split) and r.split > TOLERANCE
                                            for r in ran),
           "set_mechanism whole": sum(r.swap == "whole" for r in ran),
           "set_mechanism refused": sum(r.swap.startswith("refused") for r in ran),
           "QK-Clip bounded": sum(r.clip == "bounded" for r in ran),
           "QK-Clip refused": sum(r.clip.startswith("refused") for r in ran)}
    reasons: dict[str, int] = {}
    for r in results:
        if r.status not in ("exact", "wrong"):
            key = f"not checked: {r.reason.split(':')[0]}" if r.status == "not built" \
                else f"{r.status}: {r.reason.split(':')[0]}"
            reasons[key] = reasons.get(key, 0) + 1
    out.update(sorted(reasons.items(), key=lambda kv: -kv[1]))
    return out


def survey(types: list[str] | None = None) -> list[FamilyResult]:
    """:func:`check_family` of every model type (or of ``types``), in order (a progress bar on
    a terminal)."""
    from attnscale.progress import progress

    types = model_types() if types is None else types
    return [check_family(t) for t in progress(types, desc="families")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnscale.hf.survey",
        description="Sweep every model type of the installed transformers (attnscale vs eager, "
                    "monitor, swap, QK-Clip) and write the supported-families table.")
    parser.add_argument("--out", required=True, help="the Markdown file to write "
                                                     "(docs/families.md)")
    parser.add_argument("--force", action="store_true", help="replace a file attnscale did "
                                                             "not write")
    args = parser.parse_args(argv)
    from attnscale.io import atomic_write, check_output_path

    try:
        out = check_output_path("--out", args.out, suffixes=(".md",), force=args.force)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    atomic_write(out, render(survey()), param="--out", force=args.force)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
