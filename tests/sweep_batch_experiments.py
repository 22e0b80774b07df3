"""A batching experiment for the chunk tests (importable by worker processes, like
``sweep_experiments``).

``test-batched`` runs trials with equal ``group`` together (``group < 0``: never batched).  Every
call, batched or not, appends a line ``pid x1,x2,...`` to ``marks/calls``; a file ``fail-X`` makes
any call holding trial ``x = X`` raise, ``kill-X`` makes its process SIGKILL itself.  A trial's
result is a seeded draw, the same bytes however it ran.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from attnscale.rng import rng
from attnscale.sweep import experiment


def _call(configs: Sequence[dict]) -> list[dict]:
    folder = Path(configs[0]["marks"])
    xs = [c["x"] for c in configs]
    with open(folder / "calls", "a") as fh:
        fh.write(f"{os.getpid()} {','.join(map(str, xs))}\n")
    for x in xs:
        if (folder / f"kill-{x}").exists():
            os.kill(os.getpid(), signal.SIGKILL)
        if (folder / f"fail-{x}").exists():
            raise RuntimeError(f"trial x={x} was asked to fail")
    return [{"x": x, "sum": float(torch.randn(32, generator=rng(x, "test-batched"),
                                              dtype=torch.float64).sum())} for x in xs]


def _key(config: dict) -> int | None:
    return None if config["group"] < 0 else config["group"]


@experiment("test-batched", batch_key=_key, run_batch=_call)
def batched(*, x: int, marks: str, group: int = 0) -> dict:
    """One trial of the batching test experiment."""
    return _call([{"x": x, "marks": marks, "group": group}])[0]


def calls(marks: Path) -> list[tuple[int, ...]]:
    """The trials of every call, in order."""
    path = marks / "calls"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(int(x) for x in line.split()[1].split(",")) for line in lines]


# A held call waits at most this long (s) for its go file, then fails rather than hang the suite.
HOLD_LIMIT = 300.0


def _held_call(configs: Sequence[dict]) -> list[dict]:
    """:func:`_call`, after writing ``held-PID`` and waiting for a file ``go``: the test decides
    when a chunk may finish, so it can stop the driver while a chunk is surely in flight."""
    folder = Path(configs[0]["marks"])
    (folder / f"held-{os.getpid()}").write_text(",".join(str(c["x"]) for c in configs))
    deadline = time.monotonic() + HOLD_LIMIT
    while not (folder / "go").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("no go file within HOLD_LIMIT")
        time.sleep(0.02)
    return _call(configs)


@experiment("test-batched-held", batch_key=_key, run_batch=_held_call)
def batched_held(*, x: int, marks: str, group: int = 0) -> dict:
    """One trial of the held batching experiment."""
    return _held_call([{"x": x, "marks": marks, "group": group}])[0]
