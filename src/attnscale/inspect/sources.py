"""What one ``attnscale inspect`` PATH names: a ``save_pretrained`` folder, a ``.gguf`` file
(llama.cpp, Ollama, LM Studio), or a training run's folder of ``checkpoint-N`` subfolders.

:func:`resolve` turns the paths as given into :class:`Source` objects, checking everything that
needs no model (the folder's files, the GGUF header and architecture, the run's checkpoints and
their architectures), so that a bad path is refused before anything is loaded;
:func:`load_checkpoint` loads one :class:`Checkpoint` with ``attn_implementation="attnscale"``.

A GGUF is read by transformers' own GGUF loader (``from_pretrained(folder, gguf_file=name)``),
dequantised to the run dtype, with the tokenizer stored in the file; that loader needs the
``gguf`` package (``pip install 'attnscale[gguf]'``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from attnscale.errors import ConfigError
from attnscale.inspect.inputs import check_model_dir, load_model

# The four bytes every GGUF file starts with (the GGUF specification, ggml's docs/gguf.md).
GGUF_MAGIC = b"GGUF"
# A GGUF's fixed header: magic, version (uint32), tensor count and metadata count (uint64 each).
GGUF_HEADER_BYTES = 24
# The folders a Hugging Face Trainer saves: ``checkpoint-<global step>``
# (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR).
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
# The config fields that fix an architecture's shapes: two checkpoints of one run agree on all.
ARCHITECTURE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")
GGUF_EXTRA = "pip install 'attnscale[gguf]'"


@dataclass(frozen=True)
class Checkpoint:
    """One set of weights: a ``save_pretrained`` folder or a ``.gguf`` file."""

    path: Path  # the folder, or the .gguf file
    name: str  # the report's title
    step: int | None = None  # the Trainer's global step, for a checkpoint of a run

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file()


@dataclass(frozen=True)
class Source:
    """One PATH as given: a model (one checkpoint) or a run (checkpoints in step order)."""

    given: str
    name: str
    checkpoints: tuple[Checkpoint, ...]
    is_run: bool = False


def resolve(paths: Sequence[str | os.PathLike] | str | os.PathLike,
            param: str = "PATH") -> list[Source]:
    """The :class:`Source` of each path, checked without loading a model.

    Raises:
        ConfigError: no path, '' or a missing path, a path given twice (the same file or folder
            however spelled), a folder that is neither a checkpoint nor a run of checkpoints, a
            run whose checkpoints differ in architecture, a GGUF that is truncated, not a GGUF,
            of an architecture transformers cannot load, or read without the ``gguf`` package.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ConfigError(f"{param}: give at least one model folder, .gguf file or run folder.")
    seen: dict[Path, str] = {}
    sources = []
    for given in paths:
        if given is None or not str(os.fspath(given)).strip():
            raise ConfigError(f"{param} must be a path, got {str(given or '')!r}.")
        shown = str(os.fspath(given))
        if not os.path.exists(given):
            raise ConfigError(f"{param} {shown!r} does not exist (attnscale never downloads; pass "
                              "a local model folder, .gguf file or run folder).")
        real = Path(given).resolve()
        if real in seen:
            raise ConfigError(f"{param} {shown!r} is given twice (as {seen[real]!r} too).")
        seen[real] = shown
        sources.append(_source(Path(given), shown, param))
    _unique_names(sources)
    return sources


def _source(path: Path, shown: str, param: str) -> Source:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"{param} {shown!r} is a file but not a .gguf; pass a model folder "
                              "written by save_pretrained, a .gguf file or a run folder.")
        check_gguf(path, param)
        return Source(shown, path.stem, (Checkpoint(path, path.stem),))
    name = path.resolve().name
    if (path / "config.json").is_file():
        check_model_dir(path, param=param)
        return Source(shown, name, (Checkpoint(path, name),))
    steps = sorted((int(m.group(1)), child) for child in path.iterdir()
                   if child.is_dir() and (m := CHECKPOINT_DIR.match(child.name)))
    if not steps:
        raise ConfigError(f"{param} {shown!r} has neither a config.json (a save_pretrained "
                          "folder) nor checkpoint-N folders (a training run).")
    configs = [(child, check_model_dir(child, param=param)[1]) for _, child in steps]
    first_dir, first = configs[0]
    for child, config in configs[1:]:
        for field in ARCHITECTURE_FIELDS:
            if config.get(field) != first.get(field):
                raise ConfigError(f"{param} {shown!r} holds two architectures: {field} is "
                                  f"{first.get(field)!r} in {first_dir.name} and "
                                  f"{config.get(field)!r} in {child.name}.")
    checkpoints = tuple(Checkpoint(child, child.name, step) for step, child in steps)
    return Source(shown, name, checkpoints, is_run=True)


def _unique_names(sources: list[Source]) -> None:
    """Names that clash are told apart: a GGUF by its file name (``model.gguf`` beside the
    folder ``model``), then each by its parent folder's name too (``a-model``, ``b-model``)."""
    def rename(how) -> None:
        names = [s.name for s in sources]
        for source in sources:
            if names.count(source.name) > 1:
                object.__setattr__(source, "name", how(source))

    rename(lambda s: Path(s.given).name if Path(s.given).is_file() else s.name)
    rename(lambda s: f"{Path(s.given).resolve().parent.name}-{s.name}")
    names = [s.name for s in sources]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash is not None:
        raise ConfigError(f"two paths give the report name {clash!r}; rename one of them.")


def _gguf_reader():
    try:
        import gguf
    except ImportError:
        raise ConfigError(f"reading a .gguf needs the gguf package: {GGUF_EXTRA}") from None
    return gguf


def check_gguf(path: Path, param: str = "PATH") -> str:
    """The architecture of the GGUF file ``path`` (``general.architecture``), checked to be a
    whole GGUF of an architecture transformers' GGUF loader reads.

    The header and metadata are read, and every tensor's extent is checked against the file's
    size; no tensor is read."""
    shown = str(path)
    with open(path, "rb") as f:
        head = f.read(GGUF_HEADER_BYTES)
    if len(head) < GGUF_HEADER_BYTES or not head.startswith(GGUF_MAGIC):
        raise ConfigError(f"{param} {shown!r} is not a GGUF file (it does not start with the "
                          "GGUF header).")
    gguf = _gguf_reader()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{param} {shown!r} is not a whole GGUF file (truncated or corrupt: "
                          f"{first}).") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ConfigError(f"{param} {shown!r} is truncated: tensor {tensor.name!r} ends at "
                              f"byte {tensor.data_offset + tensor.n_bytes}, past the file's "
                              f"{size}.")
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ConfigError(f"{param} {shown!r} has no general.architecture in its metadata.")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    supported = gguf_architectures()
    if supported is not None and arch not in supported:
        raise ConfigError(f"{param} {shown!r} is a GGUF of architecture {arch!r}, which "
                          f"transformers' GGUF loader cannot read (it reads "
                          f"{', '.join(sorted(supported))}).")
    return arch


def gguf_architectures() -> frozenset[str] | None:
    """The GGUF architectures transformers' loader reads (None without transformers)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return None
    return frozenset(GGUF_SUPPORTED_ARCHITECTURES)


def load_checkpoint(path: str | os.PathLike | Checkpoint, *, dtype: str = "auto",
                    device: torch.device | str | None = None, lm_head: bool = False,
                    device_map: str | None = None, param: str = "path"):
    """``(model, tokenizer)`` of a ``save_pretrained`` folder or a ``.gguf`` file, loaded with
    ``attn_implementation="attnscale"`` in eval mode (:func:`attnscale.inspect.inputs.load_model`).

    ``lm_head``: build the language-model head too (``AutoModelForCausalLM``); otherwise the
    bare model (``AutoModel``).  A GGUF's tokenizer is the one stored in the file; it is
    dequantised to ``dtype`` (``"auto"``: float32, the loader's)."""
    if not isinstance(path, Checkpoint):
        source = resolve([path], param=param)[0]
        if source.is_run:
            raise ConfigError(f"{param} {str(path)!r} is a run folder; pass one of its "
                              "checkpoints.")
        path = source.checkpoints[0]
    auto_class = "AutoModelForCausalLM" if lm_head else "AutoModel"
    where = None if device is None else torch.device(device)
    if path.is_gguf:
        _gguf_reader()
        dtype = "float32" if dtype == "auto" else dtype
        with _quiet_gguf_loader():
            return load_model(path.path.parent, dtype=dtype, device=where, param=param,
                              gguf_file=path.path.name, auto_class=auto_class,
                              device_map=device_map)
    return load_model(path.path, dtype=dtype, device=where, param=param, auto_class=auto_class,
                      device_map=device_map)


@contextlib.contextmanager
def _quiet_gguf_loader() -> Iterator[None]:
    """transformers' GGUF loader draws a tqdm bar of its own that its progress-bar switch does
    not reach; it is silenced for the load, as every other bar of a load is."""
    try:
        from transformers import modeling_gguf_pytorch_utils as loader
    except ImportError:
        yield
        return
    bar = getattr(loader, "tqdm", None)
    if bar is None:
        yield
        return
    loader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        loader.tqdm = bar


def describe(checkpoint: Checkpoint) -> dict:
    """The report's ``meta`` fields that say which weights were read."""
    info = {"name": checkpoint.name, "model_dir": str(checkpoint.path)}
    if checkpoint.is_gguf:
        info["gguf"] = checkpoint.path.name
        info["model_dir"] = str(checkpoint.path.parent)
    if checkpoint.step is not None:
        info["step"] = checkpoint.step
    return info


def read_config(checkpoint: Checkpoint) -> dict:
    """config.json of a folder checkpoint ({} for a GGUF, whose config is in its metadata)."""
    if checkpoint.is_gguf:
        return {}
    return json.loads((checkpoint.path / "config.json").read_text(encoding="utf-8"))
