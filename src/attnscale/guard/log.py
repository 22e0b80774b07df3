"""The guard's JSONL log: one record per line, and the marks a resumed run leaves in it.

A log is written line by line as training runs (:class:`attnscale.guard.Guard` with ``log=``),
so a killed run leaves every record it wrote and at most one *torn* last line: a line without
its newline that is not JSON.  Reading leaves a torn last line out and says so once, as the sweep
store does; any other line that is not a record, or a record with a malformed value, is a
one-line :class:`~attnscale.errors.ConfigError` naming the file, the line and the field.

**Resuming** (``resume=step``): the run continues from a checkpoint taken after step ``step``.
The guard appends to the log, after a *resume mark*, one line::

    {"event": "resume", "after_step": 40, "superseded": 24}

Records above a mark whose step is later than ``after_step`` were written by the run that went on
past its checkpoint and was then stopped; the trainer rewound to the checkpoint and takes those
steps again, so the records below the mark supersede them (``superseded`` counts them).  They
stay in the file, and :func:`read_log` leaves them out: the log reads as one run.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from attnscale.columns import GUARD_STATS, named
from attnscale.errors import ConfigError

# Integer fields (>= 0) and the statistics (numbers; null, which the log writes for NaN, reads as
# NaN): those of attnscale.columns, and each head's logit_std over its first recorded value.
# s_max and clip_gamma are null on a step the clip did not run.
_COUNTS = ("step", "layer", "head", "queries", "n_keys")
_STATS = (*GUARD_STATS, "logit_std_ratio")
_CLIP = ("s_max", "clip_gamma")
# The keys of every record, in order (the columns of to_frame() and of the JSONL log).
GUARD_KEYS = ("step", "layer", "head", "module", "queries", "n_keys", *_STATS, *_CLIP, "alarm")
# The statistics of the first guard logs; a log written before a statistic was recorded lacks
# it, and reads it as NaN.
FIRST_STATS = named("logit_max", "logit_absmax", "entropy_min", "entropy_mean",
                    "max_weight_mean", "logit_std")
LATER_KEYS = tuple(key for key in GUARD_STATS if key not in FIRST_STATS)
# Alarm names, in the order they are checked.
ALARMS = ("max_logit", "entropy_floor", "entropy_collapse")
# The "event" of a resume mark.
RESUME_EVENT = "resume"


def resume_mark(after_step: int, superseded: int) -> dict:
    """The line a resumed run appends before its first record (see the module doc)."""
    return {"event": RESUME_EVENT, "after_step": after_step, "superseded": superseded}


@dataclass
class LogScan:
    """What :func:`scan_log` found: the records in effect (resume marks applied, in file order),
    the byte length up to the last complete line, and whether the file ends in a torn line or
    in a complete record that lacks its newline."""

    records: list[dict] = field(default_factory=list)
    end: int = 0
    torn: bool = False
    unterminated: bool = False


def _check_path(path: str | os.PathLike) -> Path:
    if not str(os.fspath(path)).strip():  # Path("") is the working folder
        raise ConfigError("log must be a path, got an empty string.")
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"log {str(path)!r} is not a file.")
    return path


def _record(where: str, row: object) -> dict:
    """A log line's object as a record in GUARD_KEYS order (null statistics as NaN); a resume
    mark as itself; ConfigError naming ``where`` (file and line) and the field otherwise."""
    if isinstance(row, dict) and row.get("event") == RESUME_EVENT:
        after = row.get("after_step")
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ConfigError(f"{where}: after_step of a resume mark must be an integer >= 0, "
                              f"got {after!r}.")
        return row
    if isinstance(row, dict):
        row = {**dict.fromkeys(LATER_KEYS), **row}
    if not isinstance(row, dict) or any(key not in row for key in GUARD_KEYS):
        missing = [k for k in GUARD_KEYS if not isinstance(row, dict) or k not in row]
        raise ConfigError(f"{where} is not a guard record (missing {', '.join(missing[:3])}).")
    out = {}
    for key in GUARD_KEYS:
        value = row[key]
        if key in _COUNTS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{where}: {key} must be an integer >= 0, got {value!r}.")
        elif key in _STATS or key in _CLIP:
            if value is None:
                value = None if key in _CLIP else math.nan
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where}: {key} must be a number or null, got {value!r}.")
            else:
                value = float(value)
        elif key == "module":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}: module must be a module name, got {value!r}.")
        elif key == "alarm":
            names = value.split(",") if isinstance(value, str) and value else []
            if not isinstance(value, str) or any(n not in ALARMS for n in names):
                raise ConfigError(f"{where}: alarm must be a comma-separated list of "
                                  f"{', '.join(ALARMS)} (or empty), got {value!r}.")
        out[key] = value
    return out


def _parse(path: Path, number: int, line: bytes) -> dict:
    where = f"{str(path)!r} line {number}"
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where} is not JSON ({getattr(err, 'msg', err)}).") from None
    return _record(where, row)


def _apply(records: list[dict], row: dict) -> list[dict]:
    """``records`` after the line ``row``: a record is appended, a resume mark supersedes the
    records later than its step."""
    if row.get("event") == RESUME_EVENT:
        return [r for r in records if r["step"] <= row["after_step"]]
    records.append(row)
    return records


def scan_log(path: str | os.PathLike) -> LogScan:
    """Read a guard log (see the module doc); a torn last line is left out (``torn``)."""
    path = _check_path(path)
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1                          # a torn last line has no newline
    out = LogScan(end=end)
    for number, line in enumerate(data[:end].split(b"\n"), start=1):
        if line.strip():
            out.records = _apply(out.records, _parse(path, number, line))
    tail = data[end:]
    if tail.strip():
        number = data[:end].count(b"\n") + 1
        try:
            row = json.loads(tail)
        except (json.JSONDecodeError, UnicodeDecodeError):
            out.torn = True                              # a run stopped mid-write
        else:  # complete JSON lacking only its newline is a record, not a torn write
            out.records = _apply(out.records, _record(f"{str(path)!r} line {number}", row))
            out.end, out.unterminated = len(data), True
    return out


def read_log(path: str | os.PathLike) -> list[dict]:
    """The records of a guard JSONL log, as one run: a resumed run's superseded records left
    out (see the module doc), and a torn last line left out with one warning.  ConfigError
    naming the file, the line and the field when a line is not a record or holds a malformed
    value, or when the log holds no record."""
    scan = scan_log(path)
    if scan.torn:
        warnings.warn(f"attnscale.guard: {str(os.fspath(path))!r} ends in a torn line (a run "
                      f"stopped mid-write); it is left out.", RuntimeWarning, stacklevel=2)
    if not scan.records:
        raise ConfigError(f"{str(os.fspath(path))!r} holds no guard records.")
    return scan.records


def repair_log(path: Path, scan: LogScan) -> None:
    """Before appending to a log: cut off a torn last line, or end a complete last record with
    its newline."""
    if scan.unterminated:
        with open(path, "ab") as fh:
            fh.write(b"\n")
    elif path.stat().st_size > scan.end:
        with open(path, "r+b") as fh:
            fh.truncate(scan.end)
