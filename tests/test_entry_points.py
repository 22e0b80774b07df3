"""The command runs as ``attnscale``, ``python -m attnscale`` and ``python -m attnscale.cli``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import attnscale

SRC = str(Path(attnscale.__file__).parent.parent)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("module", ["attnscale", "attnscale.cli"])
def test_python_m_runs_the_command(module):
    done = _run("-m", module, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: attnscale ") and "saturation" in done.stdout


@pytest.mark.parametrize("module", ["attnscale", "attnscale.cli"])
def test_python_m_passes_on_the_exit_code(module):
    done = _run("-m", module, "saturation", "--dk", "0")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "attnscale saturation: error:" in done.stderr


@pytest.mark.parametrize("module", ["attnscale", "attnscale.cli"])
def test_version_prints_the_package_version(module):
    done = _run("-m", module, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"attnscale {attnscale.__version__}\n"
