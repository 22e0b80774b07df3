"""Helpers shared by the subcommands: argparse formatting, output options, ``--option KEY=VALUE``,
JSON output and plain-text tables."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from attnscale.errors import ConfigError
from attnscale.io import check_output_path


def add_command(sub, name: str, *, help: str, examples: str) -> argparse.ArgumentParser:
    """Add a subcommand whose ``--help`` ends with worked ``examples``."""
    return sub.add_parser(
        name, help=help, description=help,
        epilog="examples:\n" + examples.strip("\n"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_force(p: argparse.ArgumentParser) -> None:
    """``--force``: overwrite output files attnscale did not write (see :mod:`attnscale.io`)."""
    p.add_argument("--force", action="store_true",
                   help="overwrite existing files in the way that attnscale did not write")


@dataclass(frozen=True)
class Output:
    """An output option of a command: checked by :func:`check_outputs` before the command runs."""
    dest: str
    flag: str
    kind: str = "file"                        # "file" or "dir"
    suffixes: tuple[str, ...] | None = None   # allowed extensions of a file
    files: tuple[str, ...] = ()               # names a "dir" output always receives


def add_output(p: argparse.ArgumentParser, flag: str, *, kind: str = "file",
               suffixes: Sequence[str] | None = None, files: Iterable[str] = (),
               **kwargs) -> None:
    """Add an output-path option (and ``--force``, once) and register it for :func:`check_outputs`,
    which :func:`attnscale.cli.main` runs before any work."""
    action = p.add_argument(flag, **kwargs)
    outputs = [*(p.get_default("outputs") or ()),
               Output(action.dest, flag, kind, tuple(suffixes) if suffixes else None, tuple(files))]
    p.set_defaults(outputs=outputs)
    if "force" not in {a.dest for a in p._actions}:
        add_force(p)


def check_one_study_folder(args: argparse.Namespace) -> None:
    """A study command takes exactly one of ``--out DIR`` (run), ``--resume DIR`` or ``--from DIR``
    (redraw)."""
    if sum(x is not None for x in (args.out, args.resume, args.from_dir)) != 1:
        raise ConfigError("give one of --out DIR (run), --resume DIR or --from DIR (redraw).")


def add_executor_options(p: argparse.ArgumentParser) -> None:
    """``--workers N`` and ``--ray [ADDRESS]``: where a sweep's trials run, for every command that
    runs one (the same words everywhere)."""
    p.add_argument("--workers", type=int, metavar="N",
                   help="local worker processes (default: one per core); each gets "
                        "cores / N torch threads")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run trials as Ray tasks: alone, a local Ray instance; 'auto', the "
                        "cluster started on this machine; HOST:PORT or ray://HOST:10001, a "
                        "remote one (needs pip install 'attnscale[ray]')")


def add_study_store_options(p: argparse.ArgumentParser, drawn: str) -> None:
    """``--resume DIR`` and ``--from DIR`` of a study whose ``--out`` is a sweep store;
    ``drawn`` names what the study draws from its store."""
    p.add_argument("--resume", metavar="DIR",
                   help="continue the study stored in DIR with its own settings, then draw")
    p.add_argument("--from", dest="from_dir", metavar="DIR",
                   help=f"only redraw {drawn} from the store in DIR, running nothing")


def check_outputs(args: argparse.Namespace) -> None:
    """Check every registered output path of the command (see :func:`attnscale.io.check_output_path`);
    an option left unset is skipped, two options naming the same path are an error."""
    seen: dict[Path, str] = {}
    for out in getattr(args, "outputs", None) or ():
        value = getattr(args, out.dest)
        if value is None:
            continue
        path = check_output_path(out.flag, value, kind=out.kind, suffixes=out.suffixes,
                                 files=out.files, force=args.force).resolve()
        if path in seen:
            raise ConfigError(f"{out.flag} and {seen[path]} name the same path {str(value)!r}.")
        seen[path] = out.flag


def parse_options(items: Sequence[str], mechanism: str, param: str = "--option"
                  ) -> dict[str, object]:
    """``KEY=VALUE`` options of ``mechanism``: :func:`attnscale.mechanisms.parse_options`."""
    from attnscale.mechanisms import parse_options  # the registry, only when options are read
    return parse_options(items, mechanism, param)


def print_json(obj: object) -> None:
    """Print exactly one JSON object on stdout."""
    json.dump(obj, sys.stdout, allow_nan=False)
    sys.stdout.write("\n")


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    return "-" if value is None else str(value)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """Render ``rows`` as an aligned plain-text table over ``columns``."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)

