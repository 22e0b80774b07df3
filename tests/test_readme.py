"""The README's two set-up commands are the ones CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    """The first two ```bash blocks of the README, each a single command line."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks[:2]]


def test_readme_opens_with_install_and_reproduce_then_tests():
    install, tests = _setup_commands()
    assert "\n" not in install and "\n" not in tests
    assert install.endswith("attnscale reproduce")
    assert "pip install" in install and "pip install" in tests
    assert "[test]" in tests and "pytest" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _setup_commands()[1] in ci_lines


def test_torch_requirement_excludes_2_14():
    # pip must pick the local CPU wheel of 2.13 rather than a multi-GB CUDA build of 2.14+.
    text = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(r'"torch([^"]*)"', text)
    assert "<2.14" in spec.replace(" ", "")
