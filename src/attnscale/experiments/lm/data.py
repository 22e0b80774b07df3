"""Byte-level text for the small LM: the running Python's standard library, or any text you give.

Default corpus
--------------
The ``.py`` files under ``sysconfig.get_paths()["stdlib"]``: real text that ships with every
Python, so nothing is downloaded.  Files are taken in sorted path order; a file is left out when
any folder on its path (relative to the stdlib) is in :data:`EXCLUDED_DIRS`: test suites
(``test/``, ``tests/``, ``idlelib/idle_test/``, ``lib2to3/tests/``, ``unittest/test/``, ...) and
installed packages (``site-packages/``), which are not the standard library.

Split and tokens
----------------
Every byte is a token (vocabulary 256).  Files are joined in order, each followed by one NUL
byte (:data:`SEPARATOR`, never found in text) as a document boundary.  A file goes to validation
when the BLAKE2b hash of its relative path falls in the lowest :data:`VAL_FRACTION` of the range,
so the split is deterministic and a file added later does not move any other.  A single file given
as ``data=PATH`` cannot be split by file: its last :data:`VAL_FRACTION` of bytes is validation.

Cache
-----
The token arrays are written once to ``$ATTNSCALE_CACHE/lm/<key>/`` (default
``~/.cache/attnscale``), atomically (staged then renamed), and read back on later runs.  The key
hashes the source's files with their sizes and modification times, and :data:`CORPUS_VERSION`.
The cache is never data: a folder given as ``data`` that holds the cache folder is read without
it (else every run would add its own cache files to the corpus).

Pinning
-------
:data:`DATA_PARAM` is the ``data`` parameter of the experiments that train on a corpus: a path,
stored absolute, whose :func:`fingerprint` (files, bytes and a BLAKE2b hash of the relative names,
sizes and contents) a sweep records when it is created and checks when it is resumed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from attnscale.errors import ConfigError
from attnscale.corpus import EXCLUDED_DIRS, stdlib_files  # noqa: F401
from attnscale.experiments.registry import Param

# Share of files (by path hash) held out for validation.
VAL_FRACTION = 0.05
# Document boundary between files: NUL never occurs in text.
SEPARATOR = b"\x00"
# Bumped when the corpus rule above changes, so old caches are not read.
CORPUS_VERSION = 1
# Bytes read from each file to decide whether it is text (as git and grep decide: a NUL byte).
SNIFF_BYTES = 8192
# Cache root when ATTNSCALE_CACHE is not set.
DEFAULT_CACHE = Path("~/.cache/attnscale")


@dataclass(frozen=True)
class Corpus:
    """Byte tokens of one source, split by file."""

    name: str         # "stdlib" or the resolved path given
    train: Tensor     # (N_train,) uint8
    val: Tensor       # (N_val,) uint8
    files: int        # text files read
    bytes: int        # bytes of text read (without separators)

    def describe(self) -> dict:
        """JSON-ready summary: name, files, bytes, train and validation tokens."""
        return {"name": self.name, "files": self.files, "bytes": self.bytes,
                "train_tokens": int(self.train.numel()), "val_tokens": int(self.val.numel())}


def cache_dir() -> Path:
    """``$ATTNSCALE_CACHE`` or ``~/.cache/attnscale``."""
    root = os.environ.get("ATTNSCALE_CACHE")
    if root == "":
        raise ConfigError("ATTNSCALE_CACHE is set but empty; set it to a folder or unset it.")
    return Path(root).expanduser() if root else DEFAULT_CACHE.expanduser()


def is_text(path: Path) -> bool:
    """No NUL byte in the first :data:`SNIFF_BYTES` (the test git and grep use)."""
    with open(path, "rb") as f:
        return b"\x00" not in f.read(SNIFF_BYTES)


def user_files(path: str | os.PathLike) -> tuple[Path, list[Path]]:
    """A file, or every non-hidden text file under a folder (sorted); binary files in a folder are
    skipped.  Missing, empty or binary sources are a ConfigError naming ``data``."""
    if str(path) == "":
        raise ConfigError("data must be a path to a text file or folder, got ''.")
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"data path {str(path)!r} does not exist.")
    if p.is_file():
        if p.stat().st_size == 0:
            raise ConfigError(f"data file {str(path)!r} is empty.")
        if not is_text(p):
            raise ConfigError(f"data file {str(path)!r} is binary (it holds NUL bytes), "
                              "not text.")
        return p.parent.resolve(), [p.resolve()]
    if not p.is_dir():
        raise ConfigError(f"data path {str(path)!r} is neither a file nor a folder.")
    root = p.resolve()
    cache = cache_dir().resolve()
    found = sorted((f for f in root.rglob("*") if f.is_file()
                    and not any(part.startswith(".") for part in f.relative_to(root).parts)
                    and not f.resolve().is_relative_to(cache)),
                   key=lambda f: f.relative_to(root).as_posix())
    texts = [f for f in found if f.stat().st_size > 0 and is_text(f)]
    if not texts:
        what = "only empty or binary files" if found else "no files"
        raise ConfigError(f"data folder {str(path)!r} holds {what}; it needs text files.")
    return root, texts


def is_validation(rel: str) -> bool:
    """Whether the file at relative path ``rel`` is held out (hash in the lowest VAL_FRACTION)."""
    h = int.from_bytes(hashlib.blake2b(rel.encode(), digest_size=8).digest(), "little")
    return h < VAL_FRACTION * 2 ** 64


def _cache_key(name: str, root: Path, files: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((CORPUS_VERSION, VAL_FRACTION, name, str(root))).encode())
    for f in files:
        st = f.stat()
        h.update(repr((f.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns)).encode())
    return h.hexdigest()


# fingerprint() results by the files' names, sizes and modification times: each file is read once
# per process however often a sweep checks it.
_FINGERPRINTS: dict[str, dict] = {}


def fingerprint(data: str | os.PathLike) -> dict:
    """What ``data`` (a text file or folder, as :func:`user_files` reads it) holds:
    ``{"files", "bytes", "blake2b"}``, the hash over each file's relative name, size and
    contents in order.  Missing or empty data is a ConfigError naming ``data``."""
    root, files = user_files(data)
    return files_fingerprint(root, files)


def files_fingerprint(root: Path, files: list[Path]) -> dict:
    """``{"files", "bytes", "blake2b"}`` of ``files`` under ``root``: the hash over each file's
    name relative to ``root``, size and contents in order; computed once per process for the
    same names, sizes and modification times."""
    key = _cache_key("fingerprint", root, files)
    if key not in _FINGERPRINTS:
        h = hashlib.blake2b(digest_size=16)
        total = 0
        for f in files:
            size = f.stat().st_size
            total += size
            h.update(f"{f.relative_to(root).as_posix()}\0{size}\0".encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        _FINGERPRINTS[key] = {"files": len(files), "bytes": total, "blake2b": h.hexdigest()}
    return dict(_FINGERPRINTS[key])


# The corpus parameter of an experiment (LMRunConfig.data): None for the stdlib, else a path that a
# sweep stores absolute and pins by its fingerprint.
DATA_PARAM = Param(str, None, optional=True, path=True, fingerprint=fingerprint)


def _build(root: Path, files: list[Path]) -> tuple[bytes, bytes, int]:
    """(train bytes, validation bytes, text bytes read)."""
    if len(files) == 1:
        text = files[0].read_bytes()
        cut = len(text) - max(1, int(len(text) * VAL_FRACTION))
        return text[:cut] + SEPARATOR, text[cut:] + SEPARATOR, len(text)
    train, val, total = [], [], 0
    for f in files:
        text = f.read_bytes()
        total += len(text)
        (val if is_validation(f.relative_to(root).as_posix()) else train).append(text + SEPARATOR)
    if not train or not val:  # too few files for the hash split: hold out the last one
        both = train + val
        train, val = both[:-1], both[-1:]
    return b"".join(train), b"".join(val), total


def _write_cache(target: Path, train: bytes, val: bytes, meta: dict) -> None:
    """Write the arrays and meta.json into a staging folder, then rename it to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        (staging / "train.bin").write_bytes(train)
        (staging / "val.bin").write_bytes(val)
        (staging / "meta.json").write_text(json.dumps(meta), encoding="utf-8")  # written last
        try:
            os.replace(staging, target)
        except OSError:  # another process cached it first: theirs is the same bytes
            if not (target / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _read(path: Path) -> Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def load_corpus(data: str | os.PathLike | None = None) -> Corpus:
    """The corpus: the stdlib's ``.py`` files (``data=None``) or a text file or folder.

    Token arrays come from the cache when present; see the module doc for the rules.
    """
    name = "stdlib" if data is None else str(Path(data).expanduser().resolve())
    root, files = stdlib_files() if data is None else user_files(data)
    if not files:
        raise ConfigError(f"no .py files found under the standard library at {root}.")
    target = cache_dir() / "lm" / _cache_key(name, root, files)
    if not (target / "meta.json").exists():
        train, val, total = _build(root, files)
        meta = {"name": name, "files": len(files), "bytes": total, "version": CORPUS_VERSION}
        try:
            _write_cache(target, train, val, meta)
        except OSError as err:
            raise ConfigError(f"cannot write the token cache under {cache_dir()} ({err}); "
                              "set ATTNSCALE_CACHE to a writable folder.") from None
    meta = json.loads((target / "meta.json").read_text(encoding="utf-8"))
    return Corpus(name=name, train=_read(target / "train.bin"), val=_read(target / "val.bin"),
                  files=meta["files"], bytes=meta["bytes"])


def sample_batch(tokens: Tensor, batch_size: int, seq_len: int,
                 generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random windows of ``tokens``: inputs and next-byte targets, each (B, N) int64."""
    _check_length(tokens, seq_len, "corpus")
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    return _windows(tokens, starts, seq_len)


def eval_windows(tokens: Tensor, n_windows: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """``n_windows`` evenly spaced windows over the whole split (no randomness, the same for every
    run): inputs and targets, each (W, N) int64."""
    _check_length(tokens, seq_len, "validation")
    starts = torch.linspace(0, tokens.numel() - seq_len - 1, n_windows).long()
    return _windows(tokens, starts, seq_len)


def _check_length(tokens: Tensor, seq_len: int, split: str) -> None:
    if tokens.numel() < seq_len + 1:
        raise ConfigError(f"the {split} split has {tokens.numel()} tokens, fewer than "
                          f"seq_len + 1 = {seq_len + 1}.")


def _windows(tokens: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """The windows of ``seq_len + 1`` tokens from ``starts`` (W,): inputs and next-byte targets,
    each (W, N) int64."""
    idx = starts.unsqueeze(-1) + torch.arange(seq_len + 1)      # (W, N + 1)
    window = tokens[idx].long()                                  # (W, N + 1)
    return window[:, :-1], window[:, 1:]
