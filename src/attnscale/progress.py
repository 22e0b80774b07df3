"""Progress bars for long work: tqdm on stderr, silent when stderr is not a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def progress(iterable: Iterable[T], *, desc: str, total: int | None = None,
             enabled: bool | None = None) -> Iterable[T]:
    """Wrap ``iterable`` in a tqdm bar on stderr.

    ``enabled=None`` shows the bar only when stderr is a terminal, so pipes, CI logs and ``--json``
    consumers see nothing.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, disable=not enabled, file=sys.stderr,
                leave=False, dynamic_ncols=True)
