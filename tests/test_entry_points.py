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


INTERRUPTED_IMPORT = """
import importlib.abc, sys, time

class Pause(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":               # attnscale imports PyTorch first
            print("importing", flush=True)
            time.sleep(60)
        return None

sys.meta_path.insert(0, Pause())
import attnscale_cli
sys.exit(attnscale_cli.main())
"""


def test_ctrl_c_while_attnscale_is_imported_is_one_line():
    """The console script's entry point: Ctrl-C sent to the process group while PyTorch is
    imported (the default SIGINT disposition restored in the child) ends with one line, 130."""
    import signal

    from children import sigint_default

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_IMPORT, "--help"], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=sigint_default, start_new_session=True)
    try:
        assert proc.stdout.readline() == "importing\n"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err == "attnscale: interrupted\n" and out == ""


def test_the_console_script_runs_the_command():
    done = _run("-c", "import sys, attnscale_cli; sys.argv[0] = 'attnscale'; "
                      "sys.exit(attnscale_cli.main())", "saturation", "--dk", "0")
    assert done.returncode == 2 and "attnscale saturation: error:" in done.stderr
