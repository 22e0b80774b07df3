"""Text that ships with Python: the standard library's ``.py`` files, the corpus of attnscale's
language-model study and the default text of ``attnscale inspect`` and the extension study."""

from __future__ import annotations

import sysconfig
from pathlib import Path

# Folders whose files are not part of the default corpus: test suites and installed packages.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                           "__pycache__"})


def stdlib_files() -> tuple[Path, list[Path]]:
    """The stdlib root and its ``.py`` files in the corpus, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            files.append(rel)
    return root, [root / rel for rel in sorted(files, key=lambda p: p.as_posix())]
