"""The temperature report of a checkpoint: which mechanism owns the attention temperature, what it
is now, per layer × head, and how far it has drifted from the same architecture freshly
initialised (``attnscale inspect``).

::

    from attnscale.inspect import inspect_checkpoint, write

    result = inspect_checkpoint("path/to/saved_model", seq_len=256)
    result["summary"]["saturated_heads"], result["owner"]
    result["records"]        # one flat dict per (layer, head), fields in FIELDS
    write(result, "report/")  # records.json, report.md, heatmaps.png, drift.png

Three forward passes on the same tokens, each under :func:`attnscale.monitor` (row statistics over
the keys each query attends, never the (B, H, N, N) matrix) and :mod:`.measure` (coherence and the
rms of q and k): the checkpoint, the same architecture initialised by its own ``_init_weights``
(fixed seed), and optionally the checkpoint with its temperature swapped for a registry mechanism
(the what-if).  Who owns the temperature is read per layer from the family's facts and the scale
each attention call actually applied (:mod:`.owner`).  Records and the summary:
:mod:`.records`; the files: :mod:`.report`.

Needs transformers (``pip install 'attnscale[hf]'``); it is imported when a model is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from attnscale import __version__, families
from attnscale.errors import ConfigError, check_int
from attnscale.inspect.inputs import (DTYPES, Tokens, check_model_dir, check_seq_len,
                                      fresh_model, load_model, model_inputs, resolve_device,
                                      token_ids)
from attnscale.inspect.measure import Measured, measure
from attnscale.inspect.owner import owner_sentence, owners
from attnscale.inspect.records import (FIELDS, SATURATED_ENTROPY_FRACTION, SATURATED_MAX_WEIGHT,
                                       check_thresholds, join, summary)
from attnscale.inspect.report import OUT_FILES, load, redraw, render, write  # noqa: F401
from attnscale.measure.monitor import DEFAULT_BLOCK
from attnscale.progress import progress

__all__ = ["DTYPES", "FIELDS", "OUT_FILES", "SATURATED_ENTROPY_FRACTION", "SATURATED_MAX_WEIGHT",
           "inspect_checkpoint", "inspect_model", "load", "redraw", "render", "write"]


def inspect_model(model: nn.Module, input_ids: torch.Tensor, *, init: bool = True, seed: int = 0,
                  whatif: str | None = None, block: int = DEFAULT_BLOCK,
                  saturated_weight: float = SATURATED_MAX_WEIGHT,
                  saturated_entropy: float = SATURATED_ENTROPY_FRACTION,
                  meta: dict | None = None, show_progress: bool | None = None) -> dict:
    """The temperature report of a loaded Hugging Face model running
    ``attn_implementation="attnscale"``, on ``input_ids`` (1, N).

    Args:
        model: the checkpoint, in eval mode, in any dtype and on any device (statistics are
            float32 or better).  With ``whatif`` its temperature is swapped in place (and back).
        input_ids: (B, N) token ids.
        init: also measure the same architecture freshly initialised (seed ``seed``) and give
            each statistic's drift, trained ÷ init.
        whatif: a registry mechanism to measure in place of the model's temperature, or None.
        block: queries per statistics block (memory O(B · H · block · N)).
        saturated_weight, saturated_entropy: the saturation thresholds, each in (0, 1).
        meta: extra fields for the report's ``meta`` (where the model and text came from).
        show_progress: a bar over layers on stderr (None: when stderr is a terminal).
    Returns:
        ``{"meta", "summary", "owner", "layers", "fields", "records"}``: the contents of
        records.json (:func:`write` writes them with report.md and the figures).
    """
    from attnscale import hf

    weight, entropy = check_thresholds(saturated_weight, saturated_entropy)
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    n_layers = sum(families.is_attention_layer(m) for m in model.modules())
    if not n_layers:
        raise ConfigError(f"model family {family!r} cannot be inspected: no layer of it routes "
                          "attention through transformers' AttentionInterface, which attnscale "
                          "observes.")
    if whatif is not None:
        hf.check_swappable(whatif)
    inputs = model_inputs(model, input_ids)
    passes = 1 + bool(init) + (whatif is not None)
    bar = progress(None, desc="inspect: layers", total=passes * n_layers, enabled=show_progress)

    def tick() -> None:
        bar.update(1)

    try:
        trained = measure(model, inputs, block=block, on_layer=tick)
        if not trained.records:
            raise ConfigError(f"model family {family!r} cannot be inspected: no attention call "
                              "of it was observed on attn_implementation='attnscale'.")
        bar.total = passes * sum(trained.counts.values())  # calls, where a layer makes several
        bar.refresh()
        layers = owners(model, trained.calls, trained.records)
        what = _whatif(model, inputs, whatif, block, tick) if whatif is not None else None
        fresh = None
        if init:
            fresh_net = fresh_model(model, seed)
            fresh = measure(fresh_net, model_inputs(fresh_net, input_ids), block=block,
                            on_layer=tick)
            del fresh_net
    finally:
        bar.close()
    rows = join(trained.records, None if fresh is None else fresh.records,
                None if what is None else what.records,
                max_weight=weight, entropy_fraction=entropy)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    weight_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    info = {"name": model_type, "model_type": model_type, "seq_len": int(input_ids.shape[-1]),
            "batch": int(input_ids.shape[0]), "input": "the given token ids",
            "dtype": str(weight_dtype).removeprefix("torch."),
            "device": str(next(model.parameters()).device), "seed": seed, "init": bool(init),
            "whatif": whatif, "block": block, "attnscale": __version__,
            "token_ids": input_ids.tolist(),  # the exact input, so a report can be re-measured
            **(meta or {})}
    return {"meta": info, "summary": summary(rows, max_weight=weight, entropy_fraction=entropy),
            "owner": owner_sentence(layers, model_type), "layers": layers,
            "fields": dict(FIELDS), "records": rows}


def _whatif(model: nn.Module, inputs: dict, name: str, block: int,
            tick: Callable[[], None]) -> Measured:
    """The model measured with ``name`` in place of its temperature; the temperature it had is
    put back afterwards (the native one, or the mechanism it was saved with, with its tensors)."""
    from attnscale import hf

    saved = getattr(model.config, hf.MECHANISM_ATTR, None)
    state = {k: v.clone() for k, v in model.state_dict().items() if hf.MECHANISM_ATTR in k}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf.set_mechanism(model, name)
    try:
        return measure(model, inputs, block=block, on_layer=tick)
    finally:
        if saved is None:
            hf.set_mechanism(model, None)
        else:
            hf.set_mechanism(model, saved["name"], **saved.get("options", {}))
            model.load_state_dict(state, strict=False)


def inspect_checkpoint(model_dir: str | os.PathLike, *, text: str | None = None,
                       seq_len: int = 256, whatif: str | None = None, init: bool = True,
                       seed: int = 0, device: str | None = None, dtype: str = "auto",
                       block: int = DEFAULT_BLOCK, name: str | None = None,
                       saturated_weight: float = SATURATED_MAX_WEIGHT,
                       saturated_entropy: float = SATURATED_ENTROPY_FRACTION,
                       show_progress: bool | None = None) -> dict:
    """The temperature report of a local ``save_pretrained`` folder (nothing is downloaded).

    Args:
        model_dir: the folder; loaded with ``attn_implementation="attnscale"`` (and the mechanism
            it was saved with, if :func:`attnscale.hf.set_mechanism` swapped one in).
        text: the text to read (its first ``seq_len`` tokens); None: text that ships with Python
            (the standard library's LICENSE.txt, then its source).  A folder without a tokenizer
            reads ``seq_len`` seeded random ids instead, and refuses a text.
        seq_len: tokens per forward pass.
        device: ``"auto"`` (CUDA where available), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        dtype: ``"auto"`` (as saved), ``"float32"``, ``"bfloat16"``, ``"float16"`` or
            ``"float64"``.
        name: the report's title (default: the folder's name).
        others: as :func:`inspect_model`.
    Raises:
        ConfigError: a bad folder, text or option, before any model is loaded where it can be.
    """
    path, _ = check_model_dir(model_dir)
    seq_len = check_int("seq_len", seq_len, minimum=1)
    check_thresholds(saturated_weight, saturated_entropy)
    if whatif is not None:
        from attnscale.mechanisms import check_mechanism
        check_mechanism(whatif, param="whatif")
    where = resolve_device(device)
    model, tokenizer = load_model(path, dtype=dtype, device=where)
    check_seq_len(model, seq_len)
    tokens = token_ids(tokenizer, text, seq_len, vocab_size=model.config.vocab_size, seed=seed)
    return inspect_model(model, tokens.ids, init=init, seed=seed, whatif=whatif, block=block,
                         saturated_weight=saturated_weight, saturated_entropy=saturated_entropy,
                         meta=checkpoint_meta(path, tokens, name), show_progress=show_progress)


def checkpoint_meta(path: os.PathLike, tokens: Tokens, name: str | None,
                    text_file: str | None = None) -> dict:
    """The report's ``meta`` fields that say where the model and the tokens came from."""
    source = tokens.source if text_file is None else \
        tokens.source.replace("the given text", f"the text {os.path.basename(text_file)}")
    return {"name": name or os.path.basename(os.path.abspath(path)), "model_dir": str(path),
            "input": source, "text_file": tokens.kind == "text"}
