"""Experiments registered for the sweep tests only (importable by worker processes, which find
this module through the sweep's stored module name and the tests folder on their path).

``marked`` leaves a trace of every run in its ``marks`` folder and fails on request: a file
``fail-X`` makes trial ``x = X`` raise, ``kill-X`` makes its process SIGKILL itself, as the OOM
killer would.  With ``gate=True`` a trial, once started, writes ``held-X`` (its pid and, under Ray,
its node) and waits until a file ``go-X`` or ``go-all`` exists: the tests decide when each trial
may finish, instead of guessing with sleeps.  Its result is a seeded draw, so a re-run gives the
same bytes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from attnscale.rng import rng
from attnscale.sweep import experiment

# A gated trial waits at most this long (s) for its go file, then fails rather than hang the suite.
GATE_LIMIT = 300.0


@experiment("test-marked")
def marked(*, x: int, marks: str, sleep: float = 0.0, scale: float = 1.0,
           gate: bool = False) -> dict:
    """Draw 64 normals seeded by ``x``; record the run (and the pid) in ``marks``."""
    folder = Path(marks)
    with open(folder / f"ran-{x}", "a") as fh:
        fh.write(f"{os.getpid()}\n")
    if (folder / f"kill-{x}").exists():
        os.kill(os.getpid(), signal.SIGKILL)
    if (folder / f"fail-{x}").exists():
        raise RuntimeError(f"trial x={x} was asked to fail")
    if gate:
        _wait_at_gate(folder, x)
    if sleep:
        time.sleep(sleep)
    draw = torch.randn(64, generator=rng(x, "test-marked"), dtype=torch.float64) * scale
    return {"x": x, "sum": float(draw.sum()), "max": float(draw.max())}


@experiment("test-threads", threads=None)
def threads(*, x: int) -> dict:
    """The torch thread count the executor gave this trial."""
    return {"x": x, "threads": torch.get_num_threads()}


def _wait_at_gate(folder: Path, x: int) -> None:
    node = ""
    try:
        import ray
        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    held = folder / f"held-{x}"
    with open(held.with_suffix(".tmp"), "w") as fh:
        fh.write(f"{os.getpid()} {node}\n")
    os.replace(held.with_suffix(".tmp"), held)   # readers see the whole line or nothing
    deadline = time.monotonic() + GATE_LIMIT
    while not ((folder / f"go-{x}").exists() or (folder / "go-all").exists()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"trial x={x}: its gate did not open within {GATE_LIMIT} s")
        time.sleep(0.01)


def held(marks: Path) -> dict[int, tuple[int, str]]:
    """The gated trials waiting or let through: x -> (pid, Ray node id or '') of the last run."""
    out = {}
    for p in marks.glob("held-*"):
        if p.suffix != ".tmp":
            pid, _, node = p.read_text().strip().partition(" ")
            out[int(p.name.split("-")[1])] = (int(pid), node)
    return out


def gone(pid: int) -> bool:
    """The process has exited (a zombie awaiting its reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    """Poll ``condition`` until true; AssertionError naming ``what`` after ``timeout`` s (generous,
    for a loaded machine, and bounded, so a broken test fails instead of hanging)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)


def runs(marks: Path) -> dict[int, int]:
    """How many times each ``x`` ran (lines of its ``ran-X`` file)."""
    return {int(p.name.split("-")[1]): len(p.read_text().splitlines())
            for p in marks.glob("ran-*")}


def pids(marks: Path) -> set[int]:
    """Every process that ran a trial."""
    return {int(line) for p in marks.glob("ran-*") for line in p.read_text().split()}
