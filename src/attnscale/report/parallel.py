"""Run the report's sections side by side: the calling process and ``workers - 1`` worker
processes share one list of independent section functions.

Every section is a pure function of its seed that saves its figures into the folder it is given
(:mod:`attnscale.report.sections`), so it may run anywhere: the report is the same bytes however
its sections were spread.  The calling process (the driver) runs the last section, which
:data:`attnscale.report.reproduce.SECTIONS` makes the recall section (the longest: it trains
models, on sweep worker processes of its own), and the workers take the others from the front of
the list: the Monte Carlo sections.  A worker waits for the fork server's imports (seconds) when
the run starts the fork server: meanwhile the driver runs sections from the front too, and takes
the last once a worker is up.

A worker is a fork-server process (:func:`attnscale.workers.process_context`) that ignores
SIGINT and dies with the driver; it runs torch on ``cores // workers`` intra-op threads (at least
one), and so does the driver while its workers run, so that they do not oversubscribe the cores
with spinning OpenMP threads.  The report's sections give the same numbers on one thread as on
several (their reductions do not depend on the thread count; ``tests/test_report_parallel.py``
checks a report built both ways).  A section that cannot be pickled (a lambda, a local function)
runs in the driver.  On an exception in any section, or Ctrl-C / SIGTERM in the driver, the
workers are stopped and the first error in list order is raised.

:func:`beside` runs jobs on a thread beside the caller's: the recall section's stores that
train beside its demo.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from attnscale.errors import check_int
from attnscale.report.model import Section
from attnscale.workers import die_with_parent, num_threads, process_context, start_fork_server

SectionFn = Callable[[Path], Section]  # receives the folder for its figures
# Seconds an idle worker gets to exit when asked, before it is terminated.
STOP_GRACE = 5.0


def run_sections(fns: Sequence[SectionFn], fig_dir: Path, *, workers: int = 1) -> list[Section]:
    """``[fn(fig_dir) for fn in fns]``, in order, on the driver and ``workers - 1`` worker
    processes (see the module doc); ``workers=1`` runs them one after the other here."""
    workers = check_int("workers", workers, minimum=1)
    fns = list(fns)
    last = len(fns) - 1
    # The last section is the driver's: the recall section starts sweep workers of its own.
    portable = [i != last and _picklable(fn) for i, fn in enumerate(fns)]
    n_workers = min(workers - 1, sum(portable))
    if n_workers < 1:
        return [fn(fig_dir) for fn in fns]
    results: list[Section | None] = [None] * len(fns)
    errors: dict[int, BaseException] = {}   # by section index; len(fns): a worker's start
    queue = collections.deque(range(len(fns)))   # section indices not yet taken
    lock = threading.Lock()
    ready = threading.Event()       # a worker is up
    stopping = threading.Event()    # no more sections go out

    def take(front: bool, driver: bool = False) -> int | None:
        """A worker's next section, from the front (a portable one); the driver's, from the end,
        or from the front but for the last (``front``) while its workers start."""
        with lock:
            if stopping.is_set():
                return None
            if front:
                for i in queue:
                    if (i != last) if driver else portable[i]:
                        queue.remove(i)
                        return i
                if not driver:
                    return None
            return queue.pop() if queue else None

    pool: list[_Worker] = []

    def start_and_feed() -> None:
        """Start a worker (it waits for the fork server's imports) and feed it sections."""
        try:
            worker = _Worker(fig_dir, _threads(workers))
        except Exception as exc:  # noqa: BLE001 -- raised below, after any section's error
            errors.setdefault(len(fns), exc)
            return
        with lock:
            if not stopping.is_set():
                pool.append(worker)
        if worker not in pool:  # the run ended while it started
            worker.stop(force=True)
            worker.conn.close()
            return
        ready.set()
        worker.feed(fns, take, results, errors)

    feeders: list[threading.Thread] = []
    clean = False
    try:  # everything started inside: Ctrl-C at any point stops what has started
        # A worker imports attnscale (seconds) where this run starts the fork server, or where
        # there is none (spawn): meanwhile the driver runs sections from the front, and takes
        # the last once a worker is up.
        cold = (start_fork_server()
                or process_context().get_start_method() != "forkserver")
        for _ in range(n_workers):
            feeder = threading.Thread(target=start_and_feed, daemon=True,
                                      name="attnscale-report-feeder")
            # Listed once started: start() waits for the new thread, and a signal raised in that
            # wait would leave a listed thread that cannot be joined.  An unlisted one still
            # stops its own worker, as every feeder does once ``stopping`` is set.
            feeder.start()
            feeders.append(feeder)
        while not cold and not ready.is_set() and any(t.is_alive() for t in feeders):
            ready.wait(0.05)  # a running fork server starts a worker in milliseconds
        with num_threads(_threads(workers)):  # the driver's share of the cores, as a worker's
            while not errors and (i := take(front=cold and not ready.is_set(),
                                            driver=True)) is not None:
                try:
                    results[i] = fns[i](fig_dir)
                except Exception as exc:  # noqa: BLE001 -- raised below, in list order
                    errors[i] = exc
        for t in feeders:
            while t.is_alive() and not errors:
                t.join(0.1)
        clean = not errors  # every worker idle: let each exit on its own
    finally:
        with lock:
            stopping.set()
            started = list(pool)
        for w in started:
            w.stop(force=not clean)
        for t in feeders:  # their pipes are at EOF now; a worker still starting stops itself
            t.join()
        for w in started:
            w.conn.close()
    if errors:
        raise errors[min(errors)]
    return results  # type: ignore[return-value]


def _threads(workers: int) -> int:
    """Intra-op threads of one worker: its share of the cores, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, cores // workers)


def _picklable(fn: SectionFn) -> bool:
    try:
        pickle.dumps(fn)
    except Exception:  # noqa: BLE001 -- any failure means: run it here
        return False
    return True


def _serve(conn: Connection, fig_dir: Path, threads: int) -> None:
    """Worker loop: receive ``(index, fn)``, send back ``(index, section, error)``; ``None`` or
    a closed pipe (the driver is gone) means stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    torch.set_num_threads(threads)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        i, fn = job
        try:
            reply = (i, fn(fig_dir), None)
        except Exception as exc:  # noqa: BLE001 -- the driver raises it
            reply = (i, None, exc)
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError):  # an unpicklable error
            conn.send((i, None, RuntimeError(f"{type(reply[2]).__name__}: {reply[2]}")))
        except (BrokenPipeError, OSError):
            return


class _Worker:
    """One worker process and its pipe; :meth:`feed` runs on a driver thread."""

    def __init__(self, fig_dir: Path, threads: int) -> None:
        ctx = process_context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, fig_dir, threads),
                                   name="attnscale-report-worker")
        self.process.start()
        child.close()

    def feed(self, fns: list[SectionFn], take: Callable[[bool], int | None],
             results: list, errors: dict) -> None:
        """Hand the worker one section at a time from the front of the list until none is left
        or a section failed."""
        while not errors and (i := take(True)) is not None:
            try:
                self.conn.send((i, fns[i]))
                j, section, error = self.conn.recv()
            except (EOFError, OSError):
                if not errors:  # not stopped by the driver: the process died
                    errors[i] = RuntimeError(
                        f"the worker process running report section {i} died (exit code "
                        f"{self.process.exitcode})")
                return
            if error is not None:
                errors[j] = error
            else:
                results[j] = section

    def stop(self, *, force: bool) -> None:
        """Stop the worker and reap it: ask it to exit (it is idle once every section is done),
        or, on an error or interrupt, terminate it (a section it is running is abandoned)."""
        if self.process.is_alive() and not force:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(STOP_GRACE)
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()


class Beside:
    """The results of jobs run one after another on a thread beside the caller (see
    :func:`beside`); :meth:`results` waits for them."""

    def __init__(self, jobs: Sequence[Callable[[], object]]) -> None:
        self._jobs = list(jobs)
        self._results: list = [None] * len(self._jobs)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="attnscale-report-beside")

    def _run(self) -> None:
        # SIGINT is the caller's to handle: blocked here, it is also blocked in any process this
        # thread starts (a fork server importing attnscale prints no traceback on Ctrl-C).
        if hasattr(signal, "pthread_sigmask"):  # POSIX
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for i, job in enumerate(self._jobs):
                if self._stop.is_set():
                    return
                self._results[i] = job()
        except BaseException as exc:  # noqa: BLE001 -- raised by results() in the caller
            self._error = exc

    def results(self) -> list:
        """Every job's result, in order, once all are done; a job's error is raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return list(self._results)


@contextlib.contextmanager
def beside(jobs: Sequence[Callable[[], object]]) -> Iterator[Beside]:
    """Run ``jobs`` one after another on a thread while the block runs (the recall section's
    sweep stores that train beside its demo); read them with :meth:`Beside.results`.

    On an error or interrupt in the block no further job starts: the one running finishes (it
    waits on its own worker processes) before the error goes on, unless a second interrupt
    comes first."""
    run = Beside(jobs)
    run._thread.start()
    try:
        yield run
    except BaseException:
        run._stop.set()
        run._thread.join()
        raise
    run._thread.join()
