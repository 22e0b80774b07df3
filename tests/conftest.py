"""Shared test helpers: run the CLI in-process and capture its exit code and output."""

from __future__ import annotations

import pytest

from attnscale.cli import main


@pytest.fixture
def cli(capsys):
    """``cli(*argv) -> (exit_code, stdout, stderr)``; argparse's SystemExit becomes the code."""
    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()  # drop anything printed before this call
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
        out, err = capsys.readouterr()
        return code, out, err
    return run
