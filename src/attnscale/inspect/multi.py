"""Several checkpoints in one inspection: models side by side, a training run's checkpoints in
step order, and each model at several lengths on the same text prefix.

One report folder (records.json, report.md, figures: :mod:`.report`) is written per
(model, checkpoint, length); the pages that read several of them are drawn from those stores:

* ``compare.md`` / ``compare.png`` (:mod:`.compare`), at the top, with two models or more: each
  model at the first length, a run by its last checkpoint;
* ``trajectory.md`` / ``trajectory.png`` (:mod:`.trajectory`), in a run's folder: every
  statistic against the step, the fresh initialisation as step 0;
* ``lengths.md`` / ``lengths.png`` (:mod:`.lengths`), beside a checkpoint's ``n<N>`` folders.

``inspect.json`` at the top lists every folder, so :func:`redraw` rewrites every page and report
from the stores alone, and a run that stopped resumes: a folder whose store holds the same
checkpoint, length and settings is not measured again.

Layout under ``--out``: one model at one length is the report folder itself; otherwise one
folder per model (when there are several), per checkpoint (a run), per length (``n<N>``, with
several lengths), nested in that order.

Memory: one model is loaded at a time, and its init is measured on it, re-initialised in place
after its trained passes (:func:`attnscale.inspect.inputs.reinitialise`), so one copy of the
weights is held.  A run's init pass is measured once, on its last checkpoint, and joined to
every checkpoint's records (the same architecture, seed and tokens give the same init).
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from attnscale.errors import ConfigError
from attnscale.inspect.sources import Checkpoint, Source, describe, load_checkpoint

INDEX = "inspect.json"
COMPARE_MD, COMPARE_PNG = "compare.md", "compare.png"
TRAJECTORY_MD, TRAJECTORY_PNG = "trajectory.md", "trajectory.png"
LENGTHS_MD, LENGTHS_PNG = "lengths.md", "lengths.png"
# The meta fields that must agree for a stored report to stand for a new request (resume).
# The text is named by its SHA-256 (null: the default text); the dtype where one was asked for.
RESUME_FIELDS = ("model_dir", "gguf", "step", "seq_len", "seed", "init", "whatif", "block",
                 "text_sha256", "dtype")


@dataclass(frozen=True)
class Entry:
    """One report folder: a checkpoint of a source at one length."""

    source: str
    checkpoint: str
    step: int | None
    seq_len: int
    folder: str  # relative to the output folder, POSIX ('.' for the top)


def plan(sources: Sequence[Source], lengths: Sequence[int]) -> list[Entry]:
    """Every report folder of an inspection, in measuring order."""
    entries = []
    for source in sources:
        for ckpt in source.checkpoints:
            for n in lengths:
                parts = ([source.name] if len(sources) > 1 else []) + \
                        ([ckpt.name] if source.is_run else []) + \
                        ([f"n{n}"] if len(lengths) > 1 else [])
                entries.append(Entry(source.name, ckpt.name, ckpt.step, n,
                                     PurePosixPath(*parts).as_posix() if parts else "."))
    return entries


def _checkpoint(source: Source, entry: Entry) -> Checkpoint:
    return next(c for c in source.checkpoints if c.name == entry.checkpoint)


def _title(source: Source, ckpt: Checkpoint, name: str | None, n_sources: int) -> str:
    """A report's title: ``name`` for one model, else the model's (a run's with the checkpoint's)."""
    if source.is_run:
        return f"{source.name} {ckpt.name}"
    return name if name and n_sources == 1 else source.name


def is_single(entries: Sequence[Entry]) -> bool:
    return len(entries) == 1


def _parents(entries: Sequence[Entry]) -> list[str]:
    """The folders above the report folders, the top ('.') first, parents before children."""
    found = {"."}
    for e in entries:
        found.update(str(p) for p in PurePosixPath(e.folder).parents)
    return sorted(found, key=lambda f: (f != ".", f.count("/"), f))


def check_outputs(out: Path, entries: Sequence[Entry], *, force: bool, param: str) -> None:
    """Every folder an inspection writes, checked before any model is loaded."""
    from attnscale.inspect.report import check_out
    from attnscale.io import check_output_path

    if is_single(entries):
        check_out(out, force=force, param=param)
        return
    pages = (INDEX, COMPARE_MD, COMPARE_PNG, TRAJECTORY_MD, TRAJECTORY_PNG, LENGTHS_MD,
             LENGTHS_PNG)
    check_output_path(param, out, kind="dir", files=pages, force=force)
    for folder in _parents(entries)[1:]:
        check_output_path(param, out / folder, kind="dir", files=pages, force=force)
    for e in entries:
        check_out(out / e.folder, force=force, param=param)


def _stored(out: Path, entry: Entry, want: dict) -> dict | None:
    """The payload already stored for ``entry`` when it answers the same request, else None."""
    from attnscale.inspect.report import load
    from attnscale.io import owned

    path = out / entry.folder
    if not owned(path / "records.json"):
        return None
    try:
        payload = load(path, param="--out")
    except ConfigError:
        return None
    meta = payload.get("meta") or {}
    keys = [k for k in RESUME_FIELDS if k in want or (k in meta and k != "dtype")]
    if any(meta.get(k) != want.get(k) for k in keys):
        return None
    return payload


def inspect_paths(sources: Sequence[Source], out: str | Path, *, lengths: Sequence[int],
                  text: str | None = None, text_file: str | None = None, init: bool = True,
                  seed: int = 0, whatif: str | None = None, block: int, dtype: str = "auto",
                  device=None, device_map: str | None = None, saturated_weight: float,
                  saturated_entropy: float, name: str | None = None, force: bool = False,
                  show_progress: bool | None = None, param: str = "--out",
                  params: dict | None = None) -> list[dict]:
    """Inspect every checkpoint of ``sources`` at every length and write the report folders and
    pages under ``out`` (checked first: :func:`check_outputs`); returns the payloads written,
    in :func:`plan`'s order.  ``params``: how the caller spells the parameters in messages
    (``text``, ``seq_len``, ``path``)."""
    from attnscale.inspect import check_model, checkpoint_meta, run_passes
    from attnscale.inspect.inputs import check_seq_len, token_ids, vocab_size
    from attnscale.inspect.report import write

    spell = {"text": "text", "seq_len": "seq_len", "path": "path", **(params or {})}
    out = Path(out)
    lengths = list(lengths)
    entries = plan(sources, lengths)
    check_outputs(out, entries, force=force, param=param)
    if not is_single(entries):  # the folders that hold report folders are attnscale's
        from attnscale.io import mark_folder
        for folder in _parents(entries):
            mark_folder(out / folder, command="inspect")
    text_id = None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()
    done: dict[Entry, dict] = {}
    for source in sources:
        mine = [e for e in entries if e.source == source.name]
        wants = {e: {**describe(_checkpoint(source, e)), "seq_len": e.seq_len, "seed": seed,
                     "init": bool(init), "whatif": whatif, "block": block, "text_sha256": text_id,
                     **({} if dtype == "auto" else {"dtype": dtype})} for e in mine}
        stored = {e: _stored(out, e, want) for e, want in wants.items()}
        if all(p is not None for p in stored.values()):  # resumed: measured before
            done.update(stored)
            continue
        # a run's last checkpoint first: its model is re-initialised in place for the init pass,
        # which every other checkpoint of the run then shares
        fresh = None
        for ckpt in reversed(source.checkpoints):
            at = [e for e in mine if e.checkpoint == ckpt.name]
            model, tokenizer = load_checkpoint(ckpt, dtype=dtype, device=device,
                                               device_map=device_map, param=spell["path"])
            check_seq_len(model, lengths[-1], param=spell["seq_len"])
            tokens = token_ids(tokenizer, text, lengths[-1], vocab_size=vocab_size(model),
                               seed=seed, text_param=spell["text"],
                               seq_len_param=spell["seq_len"])
            weight, entropy, family, n_layers = check_model(model, whatif, saturated_weight,
                                                            saturated_entropy)
            meta = {**checkpoint_meta(ckpt.path, tokens, None, text_file), **describe(ckpt),
                    "text_sha256": text_id, "name": _title(source, ckpt, name, len(sources))}
            payloads, measured = run_passes(
                model, tokens.ids, lengths, init=init, seed=seed, whatif=whatif, block=block,
                max_weight=weight, entropy_fraction=entropy, meta=meta,
                show_progress=show_progress, family=family, n_layers=n_layers,
                reinit_in_place=True, init_from=fresh)
            fresh = measured if init else None
            del model, tokenizer
            gc.collect()
            for e, payload in zip(at, payloads):
                write(payload, out / e.folder, force=force, param=param)
                done[e] = payload
    written = [done[e] for e in entries]
    if not is_single(entries):
        _write_index(out, sources, lengths, entries, force=force, param=param)
        draw_pages(out, force=force, param=param)
    return written


def _write_index(out: Path, sources: Sequence[Source], lengths: Sequence[int],
                 entries: Sequence[Entry], *, force: bool, param: str) -> None:
    from attnscale.io import atomic_write

    index = {"written_by": "attnscale inspect", "lengths": list(lengths),
             "sources": [{"name": s.name, "given": s.given, "run": s.is_run} for s in sources],
             "entries": [asdict(e) for e in entries]}
    atomic_write(out / INDEX, json.dumps(index, indent=1) + "\n", param=param, force=force)


def load_index(out: str | Path, param: str = "--from") -> dict:
    """``inspect.json`` of ``out``, checked: its entries name folders under ``out``."""
    path = Path(out) / INDEX
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{param} {str(path)!r} cannot be read ({err}).") from None
    entries = index.get("entries") if isinstance(index, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{param} {str(path)!r} lists no report folders (entries).")
    out_entries = []
    fields = set(Entry.__dataclass_fields__)
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or set(e) != fields:
            raise ConfigError(f"{param} {str(path)!r}: entries[{i}] must hold exactly "
                              f"{', '.join(sorted(fields))}.")
        folder = PurePosixPath(str(e["folder"]))
        if folder.is_absolute() or ".." in folder.parts:
            raise ConfigError(f"{param} {str(path)!r}: entries[{i}].folder {e['folder']!r} must "
                              "be a folder inside the output.")
        if not isinstance(e["seq_len"], int) or isinstance(e["seq_len"], bool):
            raise ConfigError(f"{param} {str(path)!r}: entries[{i}].seq_len must be an integer.")
        out_entries.append(Entry(**e))
    index["entries"] = out_entries
    return index


def draw_pages(out: str | Path, *, force: bool = False, param: str = "--from") -> list[Path]:
    """Draw every page of the inspection in ``out`` (compare, trajectories, lengths) from the
    report folders' stores and ``inspect.json``; returns the pages written."""
    from attnscale.inspect import compare, lengths, trajectory
    from attnscale.inspect.report import load
    from attnscale.io import atomic_write

    out = Path(out)
    entries = load_index(out, param)["entries"]
    payloads = {e: load(out / e.folder, param=param) for e in entries}
    first_n = min(e.seq_len for e in entries)
    written = []

    def page(folder: Path, md: str, text: str, png: str, draw) -> None:
        atomic_write(folder / png, draw, param=param, force=force)
        atomic_write(folder / md, text, param=param, force=force)
        written.append(folder / md)

    sources = list(dict.fromkeys(e.source for e in entries))
    if len(sources) > 1:  # each model at the first length, a run by its last checkpoint
        chosen = []
        for s in sources:
            mine = [e for e in entries if e.source == s and e.seq_len == first_n]
            chosen.append(payloads[mine[-1]])
        page(out, COMPARE_MD, compare.render_compare(chosen, figure=COMPARE_PNG), COMPARE_PNG,
             lambda tmp: compare.draw_compare(chosen, tmp))
    for s in sources:
        mine = [e for e in entries if e.source == s]
        checkpoints = list(dict.fromkeys(e.checkpoint for e in mine))
        if len(checkpoints) > 1 or any(e.step is not None for e in mine):
            run = [e for e in mine if e.seq_len == first_n]
            folder = out / PurePosixPath(run[0].folder).parent
            if len({e.seq_len for e in mine}) > 1:
                folder = folder.parent
            steps = [(e.step, payloads[e]) for e in run]
            page(folder, TRAJECTORY_MD, trajectory.render_trajectory(
                 steps, name=s, figure=TRAJECTORY_PNG),
                 TRAJECTORY_PNG, lambda tmp: trajectory.draw_trajectory(steps, tmp, name=s))
        for c in checkpoints:
            at = sorted((e for e in mine if e.checkpoint == c), key=lambda e: e.seq_len)
            if len(at) < 2:
                continue
            folder = out / PurePosixPath(at[0].folder).parent
            by_length = {e.seq_len: payloads[e] for e in at}
            title = s if len(checkpoints) == 1 else f"{s} {c}"
            page(folder, LENGTHS_MD, lengths.render_lengths(by_length, name=title,
                                                            figure=LENGTHS_PNG),
                 LENGTHS_PNG, lambda tmp: lengths.draw_lengths(by_length, tmp, name=title))
    return written
