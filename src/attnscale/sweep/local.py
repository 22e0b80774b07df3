"""The local executor: trials in N worker processes on this machine.

A small pool of our own rather than ``concurrent.futures.ProcessPoolExecutor``, which marks the
whole pool broken when one worker dies: here each worker has its own pipe, the driver waits on
every pipe and every process sentinel at once, and a worker that dies (a segfault, the OOM
killer's SIGKILL) costs only its trial, which is reported as an error, and is replaced.  A worker
runs a chunk of trials at a time (one, unless the experiment batches, see
:mod:`attnscale.sweep.batch`); a chunk of several whose worker dies goes back to the queue as
single trials, so only the trial that kills its worker is recorded as the error.

Workers are forked from a fork server that has imported attnscale once (so starting or replacing
a worker costs milliseconds, not a torch import, and no worker inherits the driver's torch thread
pools or locks), or spawned where there is no fork server.  They ignore SIGINT (the driver alone
decides how to stop) and die with their parent (``PR_SET_PDEATHSIG`` on Linux), so no worker
outlives an interrupted or killed sweep.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from collections.abc import Callable, Hashable, Iterable
from multiprocessing.connection import Connection, wait

from attnscale.sweep.batch import Chunk, chunks, run_chunk
from attnscale.sweep.trial import Task, outcome
# The fork server (preloaded with attnscale's experiments) and the parent-death signal.
from attnscale.workers import die_with_parent as _die_with_parent
from attnscale.workers import process_context as _context
from attnscale.workers import sigint_blocked, start_fork_server

# Seconds a stopping worker gets to exit after SIGTERM before it is killed.
STOP_GRACE = 5.0


def cpu_count() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """torch threads per worker so that workers x threads <= cores (at least 1)."""
    return max(1, cpu_count() // workers)




def _worker_main(conn: Connection) -> None:
    """Worker loop: receive a chunk of :class:`Task`, send back their outcomes; ``None`` or a
    closed pipe (the driver is gone) means stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the driver stopping it) exits through Python, so the process's finalizers run and
    # the semaphores it made (tqdm's lock) are released rather than reported as leaked.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _die_with_parent()
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        try:
            conn.send(run_chunk(chunk))
        except (BrokenPipeError, OSError):
            return


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,),
                                   name="attnscale-sweep-worker")
        if ctx.get_start_method() == "forkserver":
            # The fork server (and so every worker forked from it) starts with SIGINT ignored,
            # so a Ctrl-C sent to the whole process group prints no traceback there.  The start
            # itself waits for the server's imports (seconds, the first time), and a Ctrl-C in
            # that wait must stop the driver: only the server's launch ignores SIGINT.
            start_fork_server()
            self.process.start()
        else:  # spawn: the child is started here and inherits SIGINT ignored
            with sigint_blocked():
                self.process.start()
        child.close()
        self.chunk: Chunk | None = None
        self.sent = 0.0                    # perf_counter when the chunk was handed over

    def send(self, chunk: Chunk) -> bool:
        """Hand ``chunk`` to the worker; False when the worker is already gone."""
        try:
            self.conn.send(chunk)
        except (BrokenPipeError, OSError):
            return False
        self.chunk, self.sent = chunk, time.perf_counter()
        return True

    def stop(self, *, force: bool) -> None:
        """Stop the worker: ask politely, or SIGTERM then SIGKILL; always reap it."""
        if self.process.is_alive():
            if force:
                self.process.terminate()
            else:
                try:
                    self.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            self.process.join(STOP_GRACE)
            if self.process.is_alive():
                self.process.kill()
        self.process.join()
        self.conn.close()


def death_message(exitcode: int | None, pid: int | None) -> str:
    """One line for a worker that died mid-trial, naming the signal when there was one."""
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exit code {exitcode}"
    return f"WorkerDied: the worker process (pid {pid}) running this trial died, {how}."


def run_local(tasks: Iterable[Task], on_outcome: Callable[[dict], None], *,
              workers: int, key: Callable[[Task], Hashable | None] | None = None) -> None:
    """Run ``tasks`` on ``workers`` processes, calling ``on_outcome`` in the driver as each
    trial finishes (in completion order); ``key`` (the experiment's batch key) lets trials run
    in chunks.  On any exception, KeyboardInterrupt included, every worker is stopped before it
    propagates; trials in flight are then simply not reported."""
    pending = collections.deque(chunks(list(tasks), workers, key))
    if not pending:
        return
    ctx = _context()
    pool: list[_Worker] = []
    busy: dict[Connection | int, _Worker] = {}
    clean = False
    try:
        for _ in range(min(workers, len(pending))):  # inside try: Ctrl-C here stops them too
            pool.append(_Worker(ctx))
        idle = list(pool)
        while pending or busy:
            while pending and idle:
                worker = idle.pop()
                chunk = pending.popleft()
                if worker.send(chunk):
                    busy[worker.conn] = busy[worker.process.sentinel] = worker
                else:  # died while idle: its chunk goes back, a fresh worker takes its place
                    pending.appendleft(chunk)
                    _replace(worker, pool, idle, ctx)
            for ready in wait(list(busy)):
                worker = busy.get(ready)
                if worker is None:  # its pipe and its sentinel were both ready
                    continue
                chunk, results = worker.chunk, None
                try:  # a result sent just before the process died still counts
                    if worker.conn.poll():
                        results = worker.conn.recv()
                except (EOFError, OSError):
                    results = None
                del busy[worker.conn], busy[worker.process.sentinel]
                worker.chunk = None
                if results is not None:
                    for result in results:
                        on_outcome(result)
                    idle.append(worker)
                    continue
                worker.process.join(STOP_GRACE)
                if len(chunk) > 1:  # which trial killed it is unknown: each runs alone now
                    pending.extendleft((t,) for t in reversed(chunk))
                else:
                    on_outcome(outcome(chunk[0], "error", None,
                                       death_message(worker.process.exitcode,
                                                     worker.process.pid),
                                       time.perf_counter() - worker.sent))
                if pending:
                    _replace(worker, pool, idle, ctx)
                else:
                    worker.stop(force=True)
                    pool.remove(worker)
        clean = True
    finally:
        for worker in pool:
            worker.stop(force=not clean)


def _replace(worker: _Worker, pool: list[_Worker], idle: list[_Worker], ctx) -> None:
    worker.stop(force=True)
    pool.remove(worker)
    fresh = _Worker(ctx)
    pool.append(fresh)
    idle.append(fresh)
