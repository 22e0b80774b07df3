"""The Ray executor: each trial a Ray task, spread over a cluster's CPUs (and GPUs).

``address="local"`` starts a private local Ray instance (stopped afterwards); ``"auto"`` joins the
cluster started on this machine with ``ray start``; ``HOST:PORT`` or ``ray://HOST:10001`` joins a
remote one.  If the process is already connected (``ray.init`` called by the user), that
connection is used and left open.  :func:`connected` joins before the sweep writes its store, so
a cluster that cannot be reached leaves nothing behind; a remote address must answer within
:data:`CONNECT_TIMEOUT` seconds (``ray.init`` itself would retry for minutes).

Each task asks for ``cpus`` CPUs (its torch thread count) and ``gpus`` GPUs, and Ray retries a
task whose worker or node was lost up to :data:`MAX_RETRIES` times, on another node when its node
is gone.  A trial that raises is not retried: :func:`~attnscale.sweep.trial.run_trial` returns it
as an ``error`` outcome.  The driver alone writes the store, as with the local executor.  Every
node needs attnscale (and the module that registers the experiment) importable.

An experiment that batches runs a chunk of trials per task (:mod:`attnscale.sweep.batch`, with
as many slots as the cluster has CPUs over ``cpus``); a chunk lost more often than Ray retries it
goes back to the queue as single trials.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Hashable, Iterable, Iterator

from attnscale.errors import ConfigError, spelled
from attnscale.sweep.batch import Chunk, chunks, run_chunk
from attnscale.sweep.trial import Task, error_text, outcome

# Times Ray re-runs a task lost with its worker process or node before reporting it failed.
MAX_RETRIES = 3
# Tasks kept submitted per CPU of the cluster: enough to keep every CPU busy while the driver
# writes results, few enough that ``ray.wait`` stays cheap on huge grids.
IN_FLIGHT_PER_CPU = 2
MIN_IN_FLIGHT = 16
# Seconds a remote cluster's address gets to accept a connection before --ray gives up.
CONNECT_TIMEOUT = 10.0
# Seconds a local Ray instance's GCS server gets to bind its port.  Ray's own default is 30 s
# (``RAY_gcs_server_port_wait_time_s``); on two busy cores its start was measured past that
# (6.6 s idle), so a local start waits this long unless the user set the variable.
LOCAL_GCS_WAIT = 180
GCS_WAIT_VARIABLE = "RAY_gcs_server_port_wait_time_s"


def import_ray():
    """``ray``, or a one-line ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"{spelled('--ray', 'ray_address')} needs Ray, which is not "
                          f"installed: pip install 'attnscale[ray]'.") from None
    return ray


def _run_remote(chunk: Chunk) -> list[dict]:
    """The body of every Ray task (module level, so workers import it by name)."""
    return run_chunk(chunk)


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a remote address (``HOST:PORT`` or ``ray://HOST:PORT``), else None."""
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _check_reachable(address: str) -> None:
    """A remote address must accept a TCP connection within :data:`CONNECT_TIMEOUT` seconds."""
    target = _host_port(address)
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=CONNECT_TIMEOUT):
            pass
    except OSError as err:
        why = f"no answer within {CONNECT_TIMEOUT:g} s" if isinstance(err, TimeoutError) \
            else (err.strerror or str(err))
        raise ConfigError(f"{spelled('--ray', 'ray_address')}: no Ray cluster answers at "
                          f"{address!r} ({why}); check the "
                          f"address, or start the cluster with 'ray start --head'.") from None


@contextlib.contextmanager
def _gcs_wait(address: str) -> Iterator[None]:
    """For a local start, :data:`LOCAL_GCS_WAIT` as the GCS port wait while ``ray.init`` runs
    (the process environment is restored afterwards); a value the user set is kept."""
    if address != "local" or GCS_WAIT_VARIABLE in os.environ:
        yield
        return
    os.environ[GCS_WAIT_VARIABLE] = str(LOCAL_GCS_WAIT)
    try:
        yield
    finally:
        os.environ.pop(GCS_WAIT_VARIABLE, None)


@contextlib.contextmanager
def connected(address: str) -> Iterator[None]:
    """Join (or start) Ray at ``address`` for the block, and leave it afterwards; a connection
    the process already had is used and kept.  Failing to join is a one-line ConfigError."""
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        _check_reachable(address)
        kwargs = {"include_dashboard": False} if address == "local" else {}
        try:
            with _gcs_wait(address):
                ray.init(address=address, logging_level=logging.WARNING, **kwargs)
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise ConfigError(f"{spelled('--ray', 'ray_address')}: cannot start or join Ray "
                              f"at {address!r} "
                              f"({' '.join(str(err).split())}).") from None
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def run_ray(tasks: Iterable[Task], on_outcome: Callable[[dict], None], *, cpus: float,
            gpus: float, key: Callable[[Task], Hashable | None] | None = None) -> None:
    """Run ``tasks`` as Ray tasks on the cluster joined by :func:`connected`, calling
    ``on_outcome`` in the driver as each trial finishes; ``key`` (the experiment's batch key)
    lets trials run in chunks."""
    ray = import_ray()
    remote = ray.remote(_run_remote).options(num_cpus=cpus, num_gpus=gpus,
                                             max_retries=MAX_RETRIES, retry_exceptions=False)
    total_cpus = ray.cluster_resources().get("CPU", 1.0)
    pending = collections.deque(chunks(list(tasks), max(1, int(total_cpus / max(cpus, 1e-9))),
                                       key))
    window = max(MIN_IN_FLIGHT, int(IN_FLIGHT_PER_CPU * total_cpus / max(cpus, 1e-9)))
    in_flight: dict = {}
    try:
        while pending or in_flight:
            while pending and len(in_flight) < window:
                chunk = pending.popleft()
                in_flight[remote.remote(chunk)] = chunk
            done, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in done:
                chunk = in_flight.pop(ref)
                try:
                    results = ray.get(ref)
                except ray.exceptions.RayError as err:  # lost more often than MAX_RETRIES
                    if len(chunk) > 1:  # each trial alone now, so only a culprit fails
                        pending.extendleft((t,) for t in reversed(chunk))
                        continue
                    results = [outcome(chunk[0], "error", None, error_text(err), 0.0)]
                for result in results:
                    on_outcome(result)
    finally:
        for ref in in_flight:
            ray.cancel(ref, force=True)
