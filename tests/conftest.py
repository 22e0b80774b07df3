"""Shared test helpers: one torch thread per test, and the CLI run in-process."""

from __future__ import annotations

import pytest
import torch

from attnscale.kernels import native
from attnscale.cli import main


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread per test: the suite runs on pytest-xdist workers (one per core), and
    small tensors pay more for an OpenMP team per op than the op costs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The backends this machine has: the compiled kernels only where they were built (and not
# disabled with ATTNSCALE_NATIVE=0), the PyTorch formulations everywhere.
BACKENDS = ["compiled", "torch"] if native.available() else ["torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Run a test on attnscale's compiled kernels (where built) and on the PyTorch formulations."""
    if request.param == "torch":
        monkeypatch.setenv(native.NATIVE_ENV, "0")
    native.library.cache_clear()
    assert native.available() == (request.param == "compiled")
    yield request.param
    monkeypatch.undo()
    native.library.cache_clear()


@pytest.fixture
def text_dir(tmp_path):
    """A small text corpus: attnscale's own mechanism sources (real text, ~20 files)."""
    import shutil
    from pathlib import Path

    import attnscale
    out = tmp_path / "text"
    shutil.copytree(Path(attnscale.__file__).parent / "mechanisms", out,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return out


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


@pytest.fixture(scope="session")
def ray_home(tmp_path_factory):
    """One HOME for every Ray test of the session: a local Ray (2.59 and later) writes its token
    to ~/.ray/auth_token, and a token left in the user's home would make every later
    ``ray start --head`` there require it (see the README's cluster recipe).  One for the
    session, because a process keeps the first token it reads."""
    return tmp_path_factory.mktemp("ray-home")
