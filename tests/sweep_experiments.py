"""Experiments registered for the sweep tests only (importable by worker processes, which find
this module through the sweep's stored module name and the tests folder on their path).

``marked`` leaves a trace of every run in its ``marks`` folder and fails on request: a file
``fail-X`` makes trial ``x = X`` raise, ``kill-X`` makes its process SIGKILL itself, as the OOM
killer would.  Its result is a seeded draw, so a re-run gives the same bytes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from attnscale.rng import rng
from attnscale.sweep import experiment


@experiment("test-marked")
def marked(*, x: int, marks: str, sleep: float = 0.0, scale: float = 1.0) -> dict:
    """Draw 64 normals seeded by ``x``; record the run (and the pid) in ``marks``."""
    folder = Path(marks)
    with open(folder / f"ran-{x}", "a") as fh:
        fh.write(f"{os.getpid()}\n")
    if (folder / f"kill-{x}").exists():
        os.kill(os.getpid(), signal.SIGKILL)
    if (folder / f"fail-{x}").exists():
        raise RuntimeError(f"trial x={x} was asked to fail")
    if sleep:
        time.sleep(sleep)
    draw = torch.randn(64, generator=rng(x, "test-marked"), dtype=torch.float64) * scale
    return {"x": x, "sum": float(draw.sum()), "max": float(draw.max())}


@experiment("test-threads", threads=None)
def threads(*, x: int) -> dict:
    """The torch thread count the executor gave this trial."""
    return {"x": x, "threads": torch.get_num_threads()}


def runs(marks: Path) -> dict[int, int]:
    """How many times each ``x`` ran (lines of its ``ran-X`` file)."""
    return {int(p.name.split("-")[1]): len(p.read_text().splitlines())
            for p in marks.glob("ran-*")}


def pids(marks: Path) -> set[int]:
    """Every process that ran a trial."""
    return {int(line) for p in marks.glob("ran-*") for line in p.read_text().split()}
