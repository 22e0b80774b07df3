"""Workers: threads for independent pieces of CPU work that release the GIL (torch ops, the
compiled kernels), and the start-up rules every worker process of attnscale shares (the sweep
engine's trial workers, the report's section workers).

Used where a loop runs many small torch ops whose own intra-op parallelism is poor: running the
pieces side by side on ``torch.get_num_threads()`` threads keeps every core busy.  Where PyTorch
runs on GNU OpenMP, attnscale's kernels run such pieces on PyTorch's own threads instead
(:func:`attnscale.kernels.team.team_map`, which falls back to :func:`parallel_map` here).

Each worker runs its torch ops on one intra-op thread.  Without that, every worker's ops would
open their own OpenMP team of ``torch.get_num_threads()`` threads (the OpenMP thread count is
per calling thread), so W workers on W cores ran W² spinning threads: soft-cap attention on 2
threads was no faster than on 1 (measured on the 2-core CI machine).  The setting is per thread and made once, when the
pool starts its workers; the process-wide default that other threads start from is restored
before the pool is returned (a thread making its first torch op during those microseconds could
adopt 1 thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_tracker
from typing import TypeVar

import torch

from attnscale.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")

# Serialises the brief change of torch's process-wide thread count while a worker starts.
_THREADS_LOCK = threading.Lock()
# What the fork server imports once, so that a forked worker starts in milliseconds: the driver's
# script (experiments it defines), attnscale's experiments (the sweep) and report sections, and
# torch._dynamo, which torch.optim imports at the first optimizer (about 1 s); the guard makes the
# fork server die with the driver.  One list for every caller: a process has one fork server,
# started with the list of whichever caller comes first.
FORKSERVER_PRELOAD = ("__main__", "attnscale.sweep", "attnscale.report.reproduce", "torch._dynamo",
                      "attnscale.sweep._forkserver_guard")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads (one per size), each running torch ops on one
    intra-op thread.

    Keyed by process id too: a forked child (a DataLoader worker) inherits the parent's pool
    object but not its threads, and gets a pool of its own."""
    return _pool(workers, os.getpid())


@functools.lru_cache(maxsize=8)
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnscale",
                              initializer=_single_threaded)
    # Start every worker now, while the caller waits: ``workers`` tasks that meet at a barrier
    # run on as many threads, so each has made its one-thread setting before the pool is used.
    barrier = threading.Barrier(workers)
    for started in [pool.submit(barrier.wait, 60.0) for _ in range(workers)]:
        started.result()
    return pool


def _single_threaded() -> None:
    """Make this (new worker) thread run torch ops on one intra-op thread.

    torch.set_num_threads sets this thread's OpenMP and MKL counts and a process-wide default;
    the default is what a thread adopts at its first torch op, so this thread adopts it first
    (get_num_threads), then sets 1, and the process-wide default is put back (by setting it on
    a short-lived helper thread, so that this thread keeps 1)."""
    with _THREADS_LOCK:
        before = torch.get_num_threads()    # adopt the default now, not at the first op
        torch.set_num_threads(1)
        restore = threading.Thread(target=torch.set_num_threads, args=(before,))
        restore.start()
        restore.join()


def check_device(param: str, device: object, *, meta: bool = False) -> torch.device:
    """``device`` as a :class:`torch.device` this process can compute on, or a one-line
    :class:`~attnscale.errors.ConfigError` naming ``param``.

    Devices are told apart by kind (``torch.device(x).type``), never by their text, so ``"cpu:0"``
    is the CPU.  ``meta`` holds no data and is refused unless ``meta=True`` (a module built only
    for its shapes); CUDA needs a visible device of that index; any other kind (``mps``,
    ``xla``...) must accept a tensor in this torch build.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{param}: {device!r} is not a torch device (e.g. cpu, cuda, "
                          "cuda:1).") from None
    if dev.type == "meta" and not meta:
        raise ConfigError(f"{param}: {device!r} holds no data and cannot train or measure; use "
                          "cpu or cuda.")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ConfigError(f"{param}: {device!r}: this torch build sees no CUDA device.")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"{param}: {device!r}: only {count} CUDA device(s) visible.")
    elif dev.type not in ("cpu", "meta"):
        try:
            torch.empty(1, device=dev)
        except (RuntimeError, AssertionError, ValueError):  # backend missing or not built in
            raise ConfigError(f"{param}: {device!r} is not available in this torch build "
                              f"({torch.__version__}).") from None
    return dev


def workers_for(device: torch.device, pieces: int) -> int:
    """Threads to spread ``pieces`` over: ``torch.get_num_threads()`` on the CPU, else 1."""
    return max(1, min(torch.get_num_threads(), pieces)) if device.type == "cpu" else 1


def parallel_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """``[fn(x) for x in items]`` in order, on ``workers`` threads when it is above 1.

    Each call runs under ``torch.no_grad()`` (grad mode is per thread, and the pieces are
    computations whose gradients are written by hand); on worker threads, torch ops use one
    intra-op thread each (see the module docstring)."""
    def call(x: T) -> R:
        with torch.no_grad():
            return fn(x)

    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [call(x) for x in items]
    return list(worker_pool(workers).map(call, items))


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, restoring the previous count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def process_context():
    """The multiprocessing context of attnscale's worker processes: the fork server, preloaded
    with :data:`FORKSERVER_PRELOAD` (no worker inherits the driver's torch thread pools or
    locks, and none pays a torch import); spawn where there is no fork server."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        return ctx
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked for a process started in the block (main thread only).

    The child inherits the signal mask (multiprocessing's fork-and-exec restores the caller's),
    so a Ctrl-C sent to the whole process group never reaches the fork server while it imports
    (no traceback there), nor any worker forked from it.  The driver blocks it rather than
    ignoring it, so that it loses no Ctrl-C that arrives inside the block: another of its threads
    takes it, or it stays pending until the block ends, and either way it reaches the driver's
    own handler (a KeyboardInterrupt); an ignored signal would be discarded.  multiprocessing's
    resource tracker unblocks SIGINT after starting itself, so it is started before the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def start_fork_server() -> bool:
    """Start this process's fork server (:func:`process_context`) unless it runs, SIGINT
    blocked (:func:`sigint_blocked`), without waiting for its imports: a worker started later
    waits only for what is left of them.  Started from the main thread, before any other thread
    starts workers, it is the one such a thread uses.  True when it was started now (its
    imports take seconds); False when it already ran, or there is no fork server."""
    if process_context().get_start_method() != "forkserver":
        return False
    server = multiprocessing.forkserver._forkserver   # the process's one fork server
    before = getattr(server, "_forkserver_pid", None)
    with sigint_blocked():
        multiprocessing.forkserver.ensure_running()
    return getattr(server, "_forkserver_pid", None) != before


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, however it dies (a worker never
    outlives an interrupted or killed driver)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
