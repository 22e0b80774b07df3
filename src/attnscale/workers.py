"""Worker threads for independent pieces of CPU work that release the GIL (torch ops, the
compiled row kernel).

Used where a loop runs many small torch ops whose own intra-op parallelism is poor: running the
pieces side by side on ``torch.get_num_threads()`` threads keeps every core busy.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def worker_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads (one per size).

    Keyed by process id too: a forked child (a DataLoader worker) inherits the parent's pool
    object but not its threads, and gets a pool of its own."""
    return _pool(workers, os.getpid())


@functools.lru_cache(maxsize=8)
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnscale")


def workers_for(device: torch.device, pieces: int) -> int:
    """Threads to spread ``pieces`` over: ``torch.get_num_threads()`` on the CPU, else 1."""
    return max(1, min(torch.get_num_threads(), pieces)) if device.type == "cpu" else 1


def parallel_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """``[fn(x) for x in items]`` in order, on ``workers`` threads when it is above 1.

    Each call runs under ``torch.no_grad()`` (grad mode is per thread, and the pieces are
    computations whose gradients are written by hand)."""
    def call(x: T) -> R:
        with torch.no_grad():
            return fn(x)

    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [call(x) for x in items]
    return list(worker_pool(workers).map(call, items))
