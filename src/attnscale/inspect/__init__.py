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
from collections.abc import Callable, Sequence

import torch
from torch import nn

from attnscale import __version__, families
from attnscale.errors import ConfigError, check_int
from attnscale.inspect.inputs import (DTYPES, Tokens, check_input_ids, check_inspectable,
                                      check_lengths, check_seed, check_seq_len, fresh_model,
                                      model_inputs, reinitialise, resolve_device, token_ids,
                                      vocab_size)
from attnscale.inspect.measure import Measured, measure
from attnscale.inspect.owner import owner_sentence, owners, unmeasured_layers
from attnscale.inspect.records import (FIELDS, SATURATED_ENTROPY_FRACTION, SATURATED_MAX_WEIGHT,
                                       check_judged_length, check_thresholds, join, summary)
from attnscale.inspect.report import OUT_FILES, load, redraw, render, write  # noqa: F401
from attnscale.measure.monitor import DEFAULT_BLOCK
from attnscale.progress import progress

__all__ = ["DTYPES", "FIELDS", "OUT_FILES", "SATURATED_ENTROPY_FRACTION", "SATURATED_MAX_WEIGHT",
           "inspect_checkpoint", "inspect_lengths", "inspect_model", "inspect_paths", "load",
           "redraw", "render", "write"]


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
    return inspect_lengths(model, input_ids, [int(input_ids.shape[-1])], init=init, seed=seed,
                           whatif=whatif, block=block, saturated_weight=saturated_weight,
                           saturated_entropy=saturated_entropy, meta=meta,
                           show_progress=show_progress)[0]


def inspect_lengths(model: nn.Module, input_ids: torch.Tensor, lengths: Sequence[int], *,
                    init: bool = True, seed: int = 0, whatif: str | None = None,
                    block: int = DEFAULT_BLOCK, saturated_weight: float = SATURATED_MAX_WEIGHT,
                    saturated_entropy: float = SATURATED_ENTROPY_FRACTION,
                    meta: dict | None = None, show_progress: bool | None = None,
                    reinit_in_place: bool = False) -> list[dict]:
    """:func:`inspect_model` at each length n of ``lengths``, on the first n tokens of
    ``input_ids`` (the same text prefix): one payload per length, in the order given.

    ``reinit_in_place``: measure the init on ``model`` itself, re-initialised by its own
    ``_init_weights`` once every trained pass is done, so that one copy of the weights is held;
    ``model``'s trained weights are then lost (for a model loaded only to be inspected).
    Otherwise a second, fresh model is built and the caller's is left as it was.
    """
    check_inspectable(model)  # the model as loaded, its ids and the seed first; nothing changed
    input_ids, seed = check_input_ids(model, input_ids), check_seed(seed)
    lengths = check_lengths(lengths, int(input_ids.shape[-1]))
    weight, entropy, family, n_layers = check_model(model, whatif, saturated_weight,
                                                    saturated_entropy)
    return run_passes(model, input_ids, lengths, init=init, seed=seed, whatif=whatif, block=block,
                    max_weight=weight, entropy_fraction=entropy, meta=meta,
                    show_progress=show_progress, family=family, n_layers=n_layers,
                    reinit_in_place=reinit_in_place)[0]


def check_model(model: nn.Module, whatif: str | None, saturated_weight: float,
                saturated_entropy: float) -> tuple[float, float, str, int]:
    """The checks every inspection of a loaded model makes before its first pass: the
    thresholds, the model (its family's attention routed through attnscale) and the what-if.
    Returns the two thresholds, the family and the number of attention layers."""
    weight, entropy = check_thresholds(saturated_weight, saturated_entropy)
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    n_layers = sum(families.is_attention_layer(m) for m in model.modules())
    if not n_layers:
        raise ConfigError(f"model family {family!r} cannot be inspected: no layer of it routes "
                          "attention through transformers' AttentionInterface, which attnscale "
                          "observes.")
    if whatif is not None:
        from attnscale.inspect.owner import parse_whatif
        parse_whatif(whatif)  # NAME or NAME(KEY=VALUE, ...), as the report spells it
    return weight, entropy, family, n_layers


def run_passes(model: nn.Module, input_ids: torch.Tensor, lengths: list[int], *, init: bool,
             seed: int, whatif: str | None, block: int, max_weight: float,
             entropy_fraction: float, meta: dict | None, show_progress: bool | None, family: str,
             n_layers: int, reinit_in_place: bool = False,
             init_from: dict[int, Measured] | None = None
             ) -> tuple[list[dict], dict[int, Measured]]:
    """One payload per length n in ``lengths``: every pass on the first n tokens of
    ``input_ids``, and the init pass measured per length.  The checkpoint (and the what-if) is
    measured at every length first; then the init, either on a second model or, with
    ``reinit_in_place``, on ``model`` itself, re-initialised once (its trained weights are then
    gone: one copy of the weights is held).  ``init_from``: the init pass already measured on
    the same architecture, seed and tokens (another checkpoint of one run), used as it is."""
    ids = {n: input_ids[..., :n] for n in lengths}
    passes = (1 + bool(init and init_from is None) + (whatif is not None)) * len(lengths)
    bar = progress(None, desc="inspect: layers", total=passes * n_layers, enabled=show_progress)

    def tick() -> None:
        bar.update(1)

    trained, what, fresh = {}, {}, dict(init_from or {})
    try:
        for n in lengths:
            trained[n] = measure(model, model_inputs(model, ids[n]), block=block, on_layer=tick)
            if not trained[n].records:
                raise ConfigError(f"model family {family!r} cannot be inspected: no attention "
                                  "call of it was observed on attn_implementation='attnscale'.")
            bar.total = passes * sum(trained[n].counts.values())  # calls per layer may be > 1
            bar.refresh()
        layers = {n: owners(model, trained[n].calls, trained[n].records) for n in lengths}
        if whatif is not None:
            for n in lengths:
                what[n] = _whatif(model, model_inputs(model, ids[n]), whatif, block, tick)
        if init and init_from is None:
            if reinit_in_place:
                reinitialise(model, seed)
                net = model
            else:
                net = fresh_model(model, seed)
            for n in lengths:
                fresh[n] = measure(net, model_inputs(net, ids[n]), block=block, on_layer=tick)
            del net
    finally:
        bar.close()
    model_type = getattr(model.config, "model_type", type(model).__name__)
    weight_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    payloads = []
    for n in lengths:
        rows = join(trained[n].records, None if n not in fresh else fresh[n].records,
                    None if n not in what else what[n].records,
                    max_weight=max_weight, entropy_fraction=entropy_fraction)
        info = {"name": model_type, "model_type": model_type, "seq_len": n,
                "batch": int(input_ids.shape[0]), "input": "the given token ids",
                "dtype": str(weight_dtype).removeprefix("torch."),
                "device": str(next(model.parameters()).device), "seed": seed,
                "init": bool(init), "whatif": whatif, "block": block,
                "attnscale": __version__,
                "token_ids": ids[n].tolist(),  # the exact input, so a report can be re-measured
                **(meta or {})}
        if meta and "input" in meta and len(lengths) > 1:
            info["input"] = _at_length(meta["input"], n)
        payloads.append({"meta": info,
                         "summary": summary(rows, max_weight=max_weight,
                                            entropy_fraction=entropy_fraction),
                         "owner": owner_sentence(layers[n], model_type,
                                                 unmeasured_layers(model, layers[n])),
                         "layers": layers[n],
                         "fields": dict(FIELDS), "records": rows})
    return payloads, fresh


def _at_length(source: str, n: int) -> str:
    """The input's description at length n (the given one names the longest length's count)."""
    import re
    return re.sub(r"\(first \d+ tokens\)", f"(first {n} tokens)", source)


def _whatif(model: nn.Module, inputs: dict, spec: str, block: int,
            tick: Callable[[], None]) -> Measured:
    """The model measured with the mechanism ``spec`` (``NAME`` or ``NAME(KEY=VALUE, ...)``,
    :func:`~attnscale.inspect.owner.parse_whatif`), built with seed 0, in place of its
    temperature; the model is left exactly as it was (:func:`~attnscale.inspect.measure.kept`:
    its configs, hooks and submodules, the mechanism it held included)."""
    from attnscale import hf
    from attnscale.inspect.measure import kept
    from attnscale.inspect.owner import parse_whatif

    name, options = parse_whatif(spec)
    with kept(model):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            hf.set_mechanism(model, name, **options)
        return measure(model, inputs, block=block, on_layer=tick)


def inspect_checkpoint(model_dir: str | os.PathLike, *, text: str | None = None,
                       seq_len: int = 256, whatif: str | None = None, init: bool = True,
                       seed: int = 0, device: str | None = None, dtype: str = "auto",
                       block: int = DEFAULT_BLOCK, name: str | None = None,
                       saturated_weight: float = SATURATED_MAX_WEIGHT,
                       saturated_entropy: float = SATURATED_ENTROPY_FRACTION,
                       show_progress: bool | None = None) -> dict:
    """The temperature report of a local ``save_pretrained`` folder or ``.gguf`` file (nothing
    is downloaded), holding one copy of its weights (the init is measured on the loaded model,
    re-initialised in place).  Several paths, run folders and lengths: :func:`inspect_paths`.

    Args:
        model_dir: the folder or GGUF file; loaded with ``attn_implementation="attnscale"`` (and
            the mechanism it was saved with, if :func:`attnscale.hf.set_mechanism` swapped one
            in); a GGUF through transformers' GGUF loader, dequantised, with its own tokenizer.
        text: the text to read (its first ``seq_len`` tokens); None: text that ships with Python
            (the standard library's LICENSE.txt, then its source).  A folder without a tokenizer
            reads ``seq_len`` seeded random ids instead, and refuses a text.
        seq_len: tokens per forward pass.
        device: ``"auto"`` (CUDA where available), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        dtype: ``"auto"`` (as saved; float32 for a GGUF), ``"float32"``, ``"bfloat16"``,
            ``"float16"`` or ``"float64"``.
        name: the report's title (default: the folder's or file's name).
        others: as :func:`inspect_model`.
    Raises:
        ConfigError: a bad path, text or option, before any model is loaded where it can be.
    """
    from attnscale.inspect.sources import describe, load_checkpoint, resolve

    source = resolve([model_dir], param="model_dir")[0]
    if source.is_run:
        raise ConfigError(f"model_dir {str(model_dir)!r} is a run folder of checkpoints; "
                          "inspect it with inspect_paths.")
    seq_len = check_int("seq_len", seq_len, minimum=1)
    check_thresholds(saturated_weight, saturated_entropy)
    check_judged_length(seq_len, saturated_weight, param="seq_len")
    if whatif is not None:
        from attnscale.inspect.owner import parse_whatif
        parse_whatif(whatif)  # NAME or NAME(KEY=VALUE, ...), as the report spells it
    where = resolve_device(device)
    (ckpt,) = source.checkpoints
    model, tokenizer = load_checkpoint(ckpt, dtype=dtype, device=where, param="model_dir")
    check_seq_len(model, seq_len)
    tokens = token_ids(tokenizer, text, seq_len, vocab_size=vocab_size(model), seed=seed)
    meta = {**checkpoint_meta(ckpt.path, tokens, name), **describe(ckpt)}
    meta["name"] = name or ckpt.name
    return inspect_lengths(model, tokens.ids, [seq_len], init=init, seed=seed, whatif=whatif,
                           block=block, saturated_weight=saturated_weight,
                           saturated_entropy=saturated_entropy, meta=meta,
                           show_progress=show_progress, reinit_in_place=True)[0]


def inspect_paths(paths, out: str | os.PathLike, *, lengths: Sequence[int] = (256,),
                  text: str | None = None, init: bool = True, seed: int = 0,
                  whatif: str | None = None, device: str | None = None, dtype: str = "auto",
                  block: int = DEFAULT_BLOCK, name: str | None = None,
                  saturated_weight: float = SATURATED_MAX_WEIGHT,
                  saturated_entropy: float = SATURATED_ENTROPY_FRACTION, force: bool = False,
                  show_progress: bool | None = None) -> list[dict]:
    """Inspect every path (``save_pretrained`` folders, ``.gguf`` files, run folders of
    ``checkpoint-N``) at every length in ``lengths`` (one text prefix) and write the report
    folders, the comparison, trajectory and length pages under ``out``
    (:mod:`attnscale.inspect.multi`); returns the payloads, model by model, checkpoint by
    checkpoint (in step order), length by length.  A stopped call resumes: reports already
    stored for the same request are not measured again."""
    from attnscale.inspect.multi import inspect_paths as run
    from attnscale.inspect.sources import resolve

    sources = resolve(paths, param="paths")
    lengths = check_lengths(lengths)
    check_int("block", block, minimum=1)
    check_seed(seed, param="seed")
    check_thresholds(saturated_weight, saturated_entropy)
    for n in lengths:
        check_judged_length(n, saturated_weight, param="lengths")
    return run(sources, out, lengths=lengths, text=text, init=init, seed=seed, whatif=whatif,
               block=block, dtype=dtype, device=resolve_device(device),
               saturated_weight=saturated_weight, saturated_entropy=saturated_entropy,
               name=name, force=force, show_progress=show_progress, param="out",
               params={"text": "text", "seq_len": "lengths", "path": "paths"})


def checkpoint_meta(path: os.PathLike, tokens: Tokens, name: str | None,
                    text_file: str | None = None) -> dict:
    """The report's ``meta`` fields that say where the model and the tokens came from."""
    source = tokens.source if text_file is None else \
        tokens.source.replace("the given text", f"the text {os.path.basename(text_file)}")
    return {"name": name or os.path.basename(os.path.abspath(path)), "model_dir": str(path),
            "input": source, "text_file": tokens.kind == "text"}
