"""Output files: path checks before any work, staged atomic writes, and the output-folder policy.

Every file attnscale writes goes through this module.

Path checks
    :func:`check_output_path` is called where input enters (the CLI command, the API entry point),
    before any computation: ``''`` is never a path, a directory is not a file (and vice versa), the
    folder must be writable, a figure needs an image extension matplotlib can write.

The output-folder policy
    attnscale writes into an empty or new folder, or into a folder it wrote before, and replaces
    only its own files.  It knows its own files from a small manifest, :data:`MANIFEST`
    (``.attnscale-manifest.json``), that it keeps in every folder it writes into, single output
    files (``compare --output runs.json``) included: the manifest lists each file's name and the
    SHA-256 of the content attnscale wrote.  A file counts as attnscale's only while it still has
    that content, so a report the user edited is theirs.  Any other file in the way, or a
    non-empty folder without a manifest, is refused with a :class:`~attnscale.errors.ConfigError`
    (exit 2) unless ``force=True`` (``--force``).  Each entry also names the writer of the file
    where one is known (``"writer": "attnscale monitor"``: the command, set by the CLI with
    :func:`writing_as`, or the writer a function passes), so a command that names itself
    (``writer=``) does not replace a file of the same name that another command wrote.

Staged, atomic writes
    :func:`atomic_write` writes one file under a temporary name in its destination folder and
    renames it into place (``os.replace`` is atomic on one file system).  :func:`staged_dir`
    yields a hidden staging folder ``out/.attnscale-staging-<pid>-<random>/`` and moves its files into
    ``out`` only when the block succeeds.  On an exception, Ctrl-C (SIGINT) or SIGTERM the staging
    folder is removed and nothing partial is left: :func:`sigterm_as_exit` turns SIGTERM into
    :class:`Terminated` (``SystemExit(143)``) so that cleanup runs.  A successful write also removes
    staging left behind by an earlier run that was killed outright (SIGKILL, power loss).

One writer per folder
    :func:`exclusive` holds an exclusive lock on a folder (``fcntl.flock`` on :data:`LOCK`, which
    holds the holder's PID) for as long as a process writes it, such as a sweep's store through a
    whole run: a second writer is refused, naming the PID.  The kernel drops the lock when its
    holder dies, however it dies, so a lock left by a dead process is simply taken over.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from attnscale.errors import ConfigError, spelled

__all__ = ["LOCK", "MANIFEST", "STAGING_PREFIX", "Terminated", "atomic_write",
           "check_output_path", "exclusive", "figure_suffixes", "folder_marks", "fsync_dir",
           "mark_folder", "owned", "remove_stale_staging", "replace_atomically",
           "sigterm_as_exit", "staged_dir", "writing_as", "written_by"]

MANIFEST = ".attnscale-manifest.json"
STAGING_PREFIX = ".attnscale-staging-"
LOCK = ".attnscale-lock"
# Exit status of a process ended by SIGTERM, by the shell's 128 + signal number convention.
SIGTERM_EXIT = 128 + signal.SIGTERM
_MANIFEST_DEPTH = 3
_STAGING_PID = re.compile(re.escape(STAGING_PREFIX) + r"(\d+)-")

Data = str | bytes | Callable[[Path], object]

# The writer recorded with each file written in the block of writing_as (the CLI's command).
_WRITER: contextvars.ContextVar[str | None] = contextvars.ContextVar("attnscale_writer",
                                                                    default=None)


@contextlib.contextmanager
def writing_as(writer: str) -> Iterator[None]:
    """Record ``writer`` (``"attnscale monitor"``) in the manifest entry of every file written in
    the block that names no writer of its own; ``attnscale``'s ``main`` runs each command in
    it."""
    token = _WRITER.set(writer)
    try:
        yield
    finally:
        _WRITER.reset(token)


def _force() -> str:
    """The override of the output-folder policy, as the interface that raised spells it."""
    return spelled("--force", "force=True")


def json_safe(obj):
    """``obj`` with every NaN or infinite float replaced by None (a diverged run's loss), so that
    it can be written as strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


class Terminated(SystemExit):
    """Raised in the main thread when the process receives SIGTERM (exit status 143)."""

    def __init__(self) -> None:
        super().__init__(SIGTERM_EXIT)


# ---------------------------------------------------------------------------------------------
# Path checks


def figure_suffixes() -> tuple[str, ...]:
    """File extensions matplotlib can save a figure as (``.png``, ``.pdf``, ``.svg``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase
    return tuple(sorted("." + s for s in FigureCanvasBase.get_supported_filetypes()))


def _is_ours(name: str) -> bool:
    """attnscale's bookkeeping entries (the manifest, staging), never counted as user files."""
    return name in (MANIFEST, LOCK) or name.startswith(STAGING_PREFIX)


def _writable_folder(param: str, path: Path, shown: str) -> None:
    """The nearest existing folder at or above ``path`` must be a writable directory."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{param} {shown!r} cannot be created: {str(probe)!r} is not a "
                          "directory.")
    try:  # a real probe: os.access says yes to root even on read-only file systems and /proc
        with tempfile.TemporaryFile(dir=probe, prefix=_staging_name()):
            pass
    except OSError as err:
        raise ConfigError(f"{param} {shown!r} is not writable: cannot create a file in "
                          f"{str(probe)!r} ({err.strerror}).") from None


def check_output_path(param: str, path: str | os.PathLike | None, *, kind: str = "file",
                      suffixes: Sequence[str] | None = None, files: Iterable[str] = (),
                      force: bool = False, writer: str | None = None) -> Path:
    """Check an output path before any work and return it as a :class:`Path`; creates nothing.

    ``kind="file"``: ``path`` is a file to write; it must not be a directory, its folder must be
    writable, its extension one of ``suffixes`` (case-insensitive) when given, and an existing file
    must be one attnscale wrote (see :func:`owned`) unless ``force``.

    ``kind="dir"``: ``path`` is a folder to write into; it must not be a file, and it must be new,
    empty, or hold a manifest (a folder attnscale wrote), unless ``force``.  ``files`` are the names
    the command will write there: each existing one must be attnscale's, unless ``force``, and,
    with ``writer``, not one that another writer wrote (:func:`written_by`).
    """
    if kind not in ("file", "dir"):
        raise ValueError(f"kind must be 'file' or 'dir', got {kind!r}")
    if path is None or not str(os.fspath(path)).strip():
        raise ConfigError(f"{param} must be a path, got an empty string.")
    shown = str(os.fspath(path))
    out = Path(path)
    if kind == "file":
        if out.is_dir() or shown.endswith(os.sep):
            raise ConfigError(f"{param} {shown!r} is a directory; give a file name.")
        if suffixes is not None and out.suffix.lower() not in {s.lower() for s in suffixes}:
            raise ConfigError(f"{param} {shown!r} must end in one of {', '.join(suffixes)}.")
        _writable_folder(param, out.parent, shown)
        if out.exists() and not force and not owned(out):
            raise ConfigError(f"{param} {shown!r} exists and attnscale did not write it; choose "
                              f"another name, or pass {_force()} to overwrite it.")
        return out
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{param} {shown!r} is a file, not a directory.")
    _writable_folder(param, out, shown)
    if out.is_dir() and not force:
        present = sorted(p.name for p in out.iterdir() if not _is_ours(p.name))
        if present and not (out / MANIFEST).is_file():
            listed = ", ".join(present[:3]) + (", ..." if len(present) > 3 else "")
            raise ConfigError(f"{param} {shown!r} holds files attnscale did not write ({listed}); "
                              f"choose an empty or new folder, or pass {_force()} to write into "
                              "it.")
        _refuse_foreign(param, out, [n for n in files if (out / n).exists()], writer)
    return out


def _refuse_foreign(param: str, folder: Path, names: Iterable[str],
                    writer: str | None = None) -> None:
    """ConfigError for the first of ``names`` (existing in ``folder``) that is not attnscale's,
    or, with ``writer``, that another writer wrote."""
    for name in names:
        if (folder / name).is_dir() or not owned(folder / name):
            raise ConfigError(f"{param}: {str(folder / name)!r} exists and attnscale did not "
                              f"write it; choose another folder, or pass {_force()} to overwrite "
                              "it.")
        other = written_by(folder / name)
        if writer is not None and other not in (None, writer):
            raise ConfigError(f"{param}: {str(folder / name)!r} was written by {other}, not "
                              f"{writer}; choose another folder, or pass {_force()} to "
                              "overwrite it.")


# ---------------------------------------------------------------------------------------------
# The manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_manifest(folder: Path) -> dict[str, dict]:
    """``{name: {"sha256": ...}}`` from ``folder``'s manifest; {} when absent or unreadable."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("files", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return files if isinstance(files, dict) else {}


def owned(path: str | os.PathLike) -> bool:
    """True when ``path`` is a file attnscale wrote and nobody changed since: the manifest of its
    folder (or of a folder up to :data:`_MANIFEST_DEPTH` levels above, for a staged folder's
    subfolders) lists it with its current SHA-256."""
    path = Path(path)
    if not path.is_file():
        return False
    for folder in [path.parent, *path.parent.parents][:_MANIFEST_DEPTH]:
        entry = _read_manifest(folder).get(path.relative_to(folder).as_posix())
        if isinstance(entry, dict):
            return entry.get("sha256") == _sha256(path)
    return False


def written_by(path: str | os.PathLike) -> str | None:
    """The writer the manifest names for ``path`` (``"attnscale monitor"``), or None: a file
    attnscale did not write, or one written where no writer was named."""
    path = Path(path)
    if not owned(path):
        return None
    for folder in [path.parent, *path.parent.parents][:_MANIFEST_DEPTH]:
        entry = _read_manifest(folder).get(path.relative_to(folder).as_posix())
        if isinstance(entry, dict):
            writer = entry.get("writer")
            return writer if isinstance(writer, str) else None
    return None


def _record(folder: Path, names: Iterable[str], marks: dict | None = None,
            writer: str | None = None) -> None:
    """Add ``names`` (files now in ``folder``) to its manifest, each with its writer (``writer``,
    else the one of :func:`writing_as`, if any), and ``marks`` (what wrote the folder, see
    :func:`mark_folder`) to the marks it holds; written atomically."""
    from attnscale import __version__
    files = _read_manifest(folder)
    writer = writer or _WRITER.get()
    for name in names:
        files[name] = {"sha256": _sha256(folder / name), **({"writer": writer} if writer else {})}
    files = {n: e for n, e in sorted(files.items()) if (folder / n).is_file()}
    obj = {"written_by": "attnscale", "version": __version__, "files": files}
    kept = {**folder_marks(folder), **(marks or {})}
    text = json.dumps({**obj, **({"marks": kept} if kept else {})}, indent=1)
    replace_atomically(folder / MANIFEST, text)


def folder_marks(folder: str | os.PathLike) -> dict:
    """What the manifest of ``folder`` says wrote it (``{"command": ..., "study": ...}``); {}
    when it has no manifest or no marks."""
    try:
        marks = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8")).get("marks", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return marks if isinstance(marks, dict) else {}


def mark_folder(folder: str | os.PathLike, **marks: str) -> None:
    """Record in ``folder``'s manifest what writes it (the command, the study), creating the
    folder and the manifest if needed: one folder holds one study."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _record(folder, [], marks)


# ---------------------------------------------------------------------------------------------
# Writing


def _staging_name() -> str:
    return f"{STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale_staging(folder: str | os.PathLike) -> list[Path]:
    """Remove staging folders and temporary files in ``folder`` left by attnscale processes that
    are no longer running (killed outright); return what was removed."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        if not entry.name.startswith(STAGING_PREFIX):
            continue
        match = _STAGING_PID.match(entry.name)
        if match and _pid_alive(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
        removed.append(entry)
    return removed


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where directories can't be
    opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, data: Data, *, durable: bool = False,
                       record: Callable[[], None] | None = None) -> None:
    """Write ``data`` (text, bytes, or a callback given the temporary path) to a temporary file in
    ``path``'s folder, named as staging is (so a killed run's leftover is recognised and removed),
    then rename it onto ``path``.  ``durable``: the file is fsync'd before the rename and the
    folder after it (text and bytes only).  ``record``: called right after the rename, with Ctrl-C
    and SIGTERM held until it returns (:func:`uninterrupted`): the manifest entry of the file."""
    tmp = path.parent / f"{_staging_name()}-{path.name}"  # keeps the extension (matplotlib)
    try:
        if callable(data):
            data(tmp)
        else:
            text = isinstance(data, str)
            with open(tmp, "x" if text else "xb", encoding="utf-8" if text else None) as fh:
                fh.write(data)
                if durable:
                    fh.flush()
                    os.fsync(fh.fileno())
        with uninterrupted():
            os.replace(tmp, path)
            if record is not None:
                record()
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM for the block, then deliver the first that came: a file and its
    manifest entry change together, so an interrupted write never leaves a file attnscale wrote
    that its manifest does not list (a resume would refuse it as changed by hand).  For short
    blocks only (a rename and a small JSON write); a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    previous = {s: h for s, h in previous.items() if h is not None}  # not set from Python
    for s in previous:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            handler = previous[pending[0]]
            if callable(handler):
                handler(pending[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), pending[0])


def atomic_write(path: str | os.PathLike, data: Data, *, param: str = "output",
                 force: bool = False) -> Path:
    """Write one output file all or nothing and record it in its folder's manifest.

    ``data`` is text (UTF-8), bytes, or a callback ``fn(tmp_path)`` that writes the file (e.g. a
    matplotlib save; ``tmp_path`` keeps ``path``'s extension).  An existing file attnscale did not
    write is refused unless ``force``; SIGTERM and Ctrl-C leave no temporary file.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{param} {str(path)!r} is a directory; give a file name.")
    with sigterm_as_exit():
        if path.exists() and not force:
            _refuse_foreign(param, path.parent, [path.name])
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, data, record=lambda: _record(path.parent, [path.name]))
        remove_stale_staging(path.parent)
    return path


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike, *, param: str = "--out", force: bool = False,
               writer: str | None = None, replaces: Iterable[str] = ()) -> Iterator[Path]:
    """Yield a fresh staging folder inside ``out``; when the block succeeds, move every file written
    there into ``out`` (same relative paths), record them in the manifest (with ``writer``, see
    :func:`check_output_path`) and remove stale staging.  ``replaces``: the names a write of
    this kind produces; those this one did not write are removed from ``out`` where attnscale
    wrote them (and, with ``writer``, that writer or none), so no figure of an earlier run is
    left beside the new results.

    On an exception, Ctrl-C or SIGTERM the staging folder is removed, and so is ``out`` itself
    when this call created it and it is still empty.  A file in the way that attnscale did not
    write is refused (ConfigError) unless ``force``: check it up front with
    :func:`check_output_path`, so that no work is lost.
    """
    out = Path(out)
    created = not out.exists()
    with sigterm_as_exit():
        staging = out / _staging_name()
        done = False
        try:  # the folders are made inside: a signal as a mkdir returns still cleans up
            out.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
            yield staging
            names = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*")
                           if p.is_file())
            if not force:
                _refuse_foreign(param, out, [n for n in names if (out / n).exists()], writer)
            stale = [n for n in replaces if n not in names and owned(out / n)
                     and (writer is None or written_by(out / n) in (None, writer))]
            with uninterrupted():  # the files and their manifest entries together
                for name in names:
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staging / name, out / name)
                for name in stale:
                    (out / name).unlink()
                _record(out, names, writer=writer)
            done = True
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if done:
                remove_stale_staging(out)
            elif created:
                with contextlib.suppress(OSError):
                    out.rmdir()  # only if still empty


# ---------------------------------------------------------------------------------------------
# One writer per folder


@contextlib.contextmanager
def exclusive(folder: str | os.PathLike, *, param: str = "out") -> Iterator[Path]:
    """Hold ``folder``'s writer lock for the block (made, with the folder, if absent); another
    holder, in this process or another, is a ConfigError naming its PID.  A folder this call made
    and the block left empty is removed again.  Without ``fcntl`` (Windows) it locks nothing."""
    folder = Path(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock: one writer is the user's to ensure
        yield folder
        return
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(f"{param} {str(folder)!r} is being written by another attnscale "
                              f"process (pid {holder}); wait for it to finish or stop it, then "
                              f"run this again.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield folder
    finally:
        if created and [p.name for p in folder.iterdir()] == [LOCK]:
            with contextlib.suppress(OSError):
                (folder / LOCK).unlink()
                folder.rmdir()
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Signals


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While active, SIGTERM raises :class:`Terminated` in the main thread, so ``finally`` blocks
    (staging cleanup) run as they do for Ctrl-C.  The previous handler is restored afterwards.
    A no-op outside the main thread, or when a handler of ours is already installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is _raise_terminated:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum, frame) -> None:
    raise Terminated()
