"""The ``attnscale`` command line: a thin argparse layer over the Python API.

Each subcommand lives in ``attnscale.cli.<name>`` and exposes ``register(subparsers)``, which
adds its parser and sets ``func(args) -> int``.  Bad input raises :class:`~attnscale.errors.ConfigError`
anywhere below; it is printed here as one line and the exit code is 2.  Output paths registered
with :func:`attnscale.cli._common.add_output` are checked here before the command runs.  Ctrl-C
exits 130 and SIGTERM 143, both after the staged writes of :mod:`attnscale.io` are cleaned up;
Ctrl-C while the parser is built (it imports every command) is the same one line.  Each file a
command writes is recorded in its folder's manifest as that command's
(:func:`attnscale.io.writing_as`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from attnscale import __version__
from attnscale.cli._common import check_outputs
from attnscale.errors import ConfigError, command_line
from attnscale.io import Terminated, sigterm_as_exit, writing_as

# Explicit list, in the order ``attnscale --help`` shows them.
COMMAND_MODULES = (
    "attnscale.cli.variance",
    "attnscale.cli.saturation",
    "attnscale.cli.reproduce",
    "attnscale.cli.train",
    "attnscale.cli.compare",
    "attnscale.cli.study",
    "attnscale.cli.results",
    "attnscale.cli.monitor",
    "attnscale.cli.inspect",
    "attnscale.cli.sweep",
    "attnscale.cli.lm",
    "attnscale.cli.guard",
)


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump) with exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="attnscale",
        description="Measure, compare and swap the mechanisms that set the attention-softmax "
                    "temperature.",
        epilog="Run 'attnscale COMMAND --help' for worked examples of each command.",
    )
    parser.add_argument("--version", action="version", version=f"attnscale {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # building the parser imports every command: Ctrl-C there is one line too
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("attnscale: interrupted", file=sys.stderr)
        return 130
    try:
        # errors spell options as the CLI does; each file written is recorded as the command's
        with sigterm_as_exit(), command_line(), writing_as(f"attnscale {args.command}"):
            check_outputs(args)
            return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"attnscale {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnscale {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated as err:
        print(f"attnscale {args.command}: terminated", file=sys.stderr)
        return int(err.code)

