"""Independent pieces of CPU work spread over PyTorch's own OpenMP threads.

:func:`attnscale.workers.parallel_map` runs pieces on a pool of Python threads.  On a CPU where
PyTorch runs its ops on a GNU OpenMP team, that pool competes with the team: after each op the
team's threads spin-wait for a while (libgomp's default spin count) on the very cores the pool
wants.  On the 2-core machine attnscale is measured on, the blockwise kernels lost about a
tenth of their time to it (soft-cap attention, forward + backward at B4 H8 N1024 d64 on 2
threads: 278 ms, against 244 ms with the team told not to spin, ``OMP_WAIT_POLICY=passive``).

:func:`team_map` runs the pieces on the calling thread's OpenMP team instead, through the compiled
kernels' ``attnscale_team`` (which shares PyTorch's libgomp): the team's threads call back into
Python, take the pieces one by one, and run their torch ops on one intra-op thread each (inside
an OpenMP region PyTorch and its BLAS do not open another).  Where the kernels were built without
OpenMP, or are not available, it is :func:`attnscale.workers.parallel_map`; and so it is in a
process forked from one that had loaded them: GNU OpenMP's team does not survive a fork (its
threads are not copied, and a parallel region in the child waits for them forever, PyTorch's own
ops included), while the pool of Python threads is rebuilt in the child.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import Tensor

from attnscale.kernels import native
from attnscale.workers import parallel_map

T = TypeVar("T")
R = TypeVar("R")

# Set in a child forked from this process: its OpenMP team is unusable there (module docstring).
_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def usable() -> bool:
    """Whether this process can run work on OpenMP teams of its own: the compiled kernels have
    OpenMP, and the process is not a fork of one that loaded them."""
    return not _forked and native.openmp()


def team_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """``[fn(x) for x in items]`` in order, on ``workers`` threads of the calling thread's OpenMP
    team when it is above 1; the contract of :func:`attnscale.workers.parallel_map` (each call
    under ``torch.no_grad()``, torch ops on one intra-op thread on each worker).  The first
    exception a piece raises is raised here, after the other threads have stopped taking pieces.
    """
    items = list(items)
    if workers <= 1 or len(items) <= 1 or not usable():
        return parallel_map(fn, items, workers)
    results: list = [None] * len(items)
    taken = iter(range(len(items)))
    lock = threading.Lock()
    failed: list[BaseException] = []

    def worker(thread: int, threads: int) -> None:
        try:
            with torch.no_grad():
                while not failed:
                    with lock:
                        i = next(taken, None)
                    if i is None:
                        return
                    results[i] = fn(items[i])
        except BaseException as error:  # re-raised on the calling thread
            failed.append(error)

    native.team(min(workers, len(items)), worker)
    if failed:
        raise failed[0]
    return results


def run_blocks(run: Callable[[Tensor, int], None], shape: tuple[int, int, int, int], rows: int,
               causal: bool, workers: int) -> None:
    """Run a C block loop (:func:`native.softmax_rows_attention`, :func:`native.peak_rows`) over
    (B, H, Nq) of ``shape`` (B, H, Nq, Nk) in blocks of ``rows`` queries of one head, listed
    largest first (under causality a block sees the keys up to its last query), on ``workers``
    threads: ``run(blocks, threads)`` once, on this thread's OpenMP team, where :func:`usable`;
    else the blocks dealt out in turn to ``workers`` calls of one thread each on the pool of
    Python threads."""
    n_b, n_h, n_q, n_k = shape
    starts = sorted(range(0, n_q, rows), key=lambda i0: -(min(n_k, i0 + rows) if causal else 0))
    blocks = [(b, h, i0, min(rows, n_q - i0)) for i0 in starts for b in range(n_b)
              for h in range(n_h)]
    workers = min(workers, len(blocks))
    if workers <= 1 or usable():
        run(torch.tensor(blocks, dtype=torch.int64), max(1, workers))
        return
    shares = [blocks[w::workers] for w in range(workers)]
    team_map(lambda share: run(torch.tensor(share, dtype=torch.int64), 1), shares, workers)
