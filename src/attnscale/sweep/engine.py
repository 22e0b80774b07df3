"""Running a sweep: plan the trials, skip the finished ones, execute the rest, record each.

:func:`run` starts (or continues) a sweep from an experiment and a grid, :func:`resume` continues
the sweep stored in a folder, and :func:`load` reads one back.  Resume rules:

* a trial with an ``ok`` record is never run again;
* a trial with an ``error`` record is run again only with ``retry_errors``;
* a trial with no record (never started, or in flight when the sweep stopped) is run;
* the canonical settings must equal the stored ones (a ConfigError names each difference),
  except that with ``extend`` the grid may gain values (and a fixed key may become a grid key
  that keeps its value), which runs just the new trials;
* every file a trial reads (a path parameter) must still hold what it held when the sweep was
  created (the fingerprints in ``sweep.json``);
* one process writes the store at a time (:meth:`Store.locked`), from the first read of its
  spec to the last record.

Stopping: Ctrl-C (KeyboardInterrupt) and SIGTERM (:class:`attnscale.io.Terminated`) alike stop
every worker, with the finished trials recorded, and propagate (the CLI exits 130 or 143).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from attnscale.errors import ConfigError, check_float, check_int, did_you_mean, spelled
from attnscale.io import owned, sigterm_as_exit
from attnscale.progress import progress
from attnscale.experiments import registry
from attnscale.sweep.grid import SweepSpec, check_grid, check_pins, differences, extended
from attnscale.sweep.local import cpu_count, run_local, threads_per_worker
from attnscale.sweep.results import SweepResults, load
from attnscale.sweep.store import Store
from attnscale.sweep.trial import Task, Trial

__all__ = ["run", "resume", "load"]


def run(experiment: str, grid: Mapping[str, Sequence[Any]], out: str | os.PathLike, *,
        fixed: Mapping[str, Any] | None = None, workers: int | None = None,
        ray_address: str | None = None, cpus_per_trial: float | None = None,
        gpus_per_trial: float = 0, resume: bool = True, retry_errors: bool = False,
        extend: bool = False, force: bool = False,
        show_progress: bool | None = None) -> SweepResults:
    """Run every trial of ``experiment`` over the Cartesian product of ``grid`` into ``out``.

    ``grid`` maps parameter names to lists of values, ``fixed`` sets other parameters (the rest
    keep their defaults).  ``workers`` local processes (default: one per core) run the trials,
    or Ray tasks when ``ray_address`` is given (``"local"`` starts a private Ray instance,
    ``"auto"`` joins the cluster on this machine, ``"HOST:PORT"`` a remote one).

    If ``out`` already holds this sweep it is continued (``resume=False`` refuses instead); if it
    holds another one, a ConfigError names the differences, unless ``extend`` and the new grid
    only adds values.  A new sweep needs ``out`` new, empty or written by attnscale, unless
    ``force`` (which also lets a ``sweep.json`` changed by hand be continued as it reads).
    One process at a time writes a store: another writer is refused, naming its PID.  Returns
    the records, as :func:`load` does.
    """
    exp = registry.get(experiment)
    spec = SweepSpec.build(exp, grid, fixed)
    executor = _executor(exp, workers, ray_address, cpus_per_trial, gpus_per_trial)
    store = Store(out)
    if not store.exists():  # checked before any folder is made (and again under the lock)
        _check_trials(exp, spec.trials())
    store.check(new=not store.exists(), force=force)
    with sigterm_as_exit(), _connected(executor), store.locked():
        if not store.exists():
            return _execute(store, spec, exp, executor, retry_errors, show_progress,
                            write_spec=True, new=True)
        old = _stored(store, force)
        diffs = differences(old, spec, exp)
        if old.experiment == exp.name:
            check_pins(exp, old, str(store.path))
        if diffs and extend:
            spec = extended(old, spec, exp)
        elif diffs:
            raise ConfigError(f"{spelled('--out', 'out')} {str(store.path)!r} holds another "
                              f"sweep ({'; '.join(diffs)}); resume it as it is, pass "
                              f"{spelled('--extend', 'extend=True')} to add values to its grid, "
                              f"or choose another folder.")
        elif not resume:
            raise ConfigError(f"{spelled('--out', 'out')} {str(store.path)!r} already holds this "
                              f"sweep; resume it or choose another folder.")
        else:
            spec = old
        return _execute(store, spec, exp, executor, retry_errors, show_progress,
                        write_spec=bool(diffs) or force, new=False)


def resume(out: str | os.PathLike, *, grid: Mapping[str, Sequence[Any]] | None = None,
           extend: bool = False, workers: int | None = None, ray_address: str | None = None,
           cpus_per_trial: float | None = None, gpus_per_trial: float = 0,
           retry_errors: bool = False, force: bool = False,
           show_progress: bool | None = None) -> SweepResults:
    """Continue the sweep stored in ``out``.  ``grid`` (with ``extend``) gives new value lists
    for some keys; keys it does not name keep theirs.  ``force`` continues a sweep whose
    ``sweep.json`` was changed by hand, as it now reads."""
    store = Store(out)
    old = _stored(store, force)
    exp = experiment_of(old, store)
    executor = _executor(exp, workers, ray_address, cpus_per_trial, gpus_per_trial)
    updates = check_grid(exp, grid) if grid else {}
    store.check(new=False)
    with sigterm_as_exit(), _connected(executor), store.locked():
        old = _stored(store, force)  # again, now that no one else can change it
        check_pins(exp, old, str(store.path))
        spec = old
        if updates:
            new = SweepSpec.build(exp, {**old.grid, **updates},
                                  {k: v for k, v in old.base.items() if k not in updates})
            diffs = differences(old, new, exp)
            if diffs and not extend:
                raise ConfigError(f"the grid differs from the sweep in {str(store.path)!r} "
                                  f"({'; '.join(diffs)}); pass "
                                  f"{spelled('--extend', 'extend=True')} to add these trials.")
            spec = extended(old, new, exp) if diffs else old
        return _execute(store, spec, exp, executor, retry_errors, show_progress,
                        write_spec=spec is not old or force, new=False)


def _stored(store: Store, force: bool) -> SweepSpec:
    """The stored spec, its values checked; refused when ``sweep.json`` was changed by hand,
    unless ``force``."""
    spec = store.read_spec()
    experiment_of(spec, store)  # a bad value is named before --force is suggested
    if not force and not owned(store.spec_path):
        raise ConfigError(f"{str(store.spec_path)!r} was changed since attnscale wrote it; "
                          f"restore it, or pass {spelled('--force', 'force=True')} to continue "
                          f"the sweep as the file now reads (see it with 'attnscale sweep --show "
                          f"{store.path}').")
    return spec


def experiment_of(spec: SweepSpec, store: Store | None = None) -> registry.Experiment:
    """The experiment a stored sweep runs, importing the module that registers it if needed;
    its stored values are checked against the parameters (a ConfigError names the field)."""
    where = f" in {str(store.spec_path)!r}" if store is not None else ""
    if spec.experiment not in registry.EXPERIMENTS:
        if spec.module == "__main__":
            script = f" {spec.script!r}" if spec.script else ""
            raise ConfigError(f"the sweep's experiment {spec.experiment!r}{where} is defined in "
                              f"the script{script}, which this process did not run; resume it "
                              f"from Python, with sweep.resume(...) in that script (or a script "
                              f"that imports the module defining it).")
        try:
            importlib.import_module(spec.module)
        except ImportError as err:
            raise ConfigError(f"the sweep's experiment {spec.experiment!r}{where} is registered "
                              f"by module {spec.module!r}, which cannot be imported "
                              f"({err}).") from None
    if spec.experiment not in registry.EXPERIMENTS:
        raise ConfigError(f"the sweep's experiment {spec.experiment!r}{where} is not registered "
                          f"by module {spec.module!r}."
                          f"{did_you_mean(spec.experiment, registry.EXPERIMENTS)} Restore the "
                          f"file, or start the sweep again in a new folder.")
    exp = registry.get(spec.experiment)
    for field, values in (("grid", spec.grid), ("base", {k: [v] for k, v in spec.base.items()})):
        for key, items in values.items():
            if key not in exp.params:
                raise ConfigError(f"field {field!r}{where} holds {key!r}, which experiment "
                                  f"{exp.name!r} does not take.{did_you_mean(key, exp.params)} "
                                  f"Restore the file, or start the sweep again in a new folder.")
            for v in items:
                try:
                    exp.params[key].value(key, v)
                except ConfigError as err:
                    raise ConfigError(f"field {field!r}{where}: {str(err).rstrip('.')}; restore "
                                      f"the file, or start the sweep again in a new "
                                      f"folder.") from None
    return exp


@contextlib.contextmanager
def _connected(executor: dict) -> Iterator[None]:
    """The executor's connection for the block (Ray's; none locally), made before the store is
    written, so that a failed start leaves the folder as it was."""
    if executor["kind"] != "ray":
        yield
        return
    from attnscale.sweep.ray_exec import connected
    with connected(executor["address"]):
        yield


def _check_main_importable() -> None:
    """The local workers start as multiprocessing's forkserver children, which re-run the
    driver's ``__main__`` from its file; a ``__main__`` read from stdin (``python - <<EOF``) names
    a file that does not exist, and every trial would fail on it.  Refuse that before any work."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and isinstance(path, str) and \
            not os.path.isfile(path):
        raise ConfigError(f"the local sweep workers re-import the driver's __main__, which was "
                          f"read from {path!r}, not a file; run the sweep from a script file, "
                          "with python -m or -c, in a notebook, or with the attnscale command.")


def _executor(exp: registry.Experiment, workers, ray_address, cpus_per_trial,
              gpus_per_trial) -> dict:
    """Check the executor options; return how to run tasks."""
    gpus_name = spelled("--gpus-per-trial", "gpus_per_trial")
    gpus = check_float(gpus_name, gpus_per_trial)
    if gpus < 0:
        raise ConfigError(f"{gpus_name} must be >= 0, got {gpus_per_trial!r}.")
    if ray_address is None:
        if gpus:
            raise ConfigError(f"{gpus_name} needs the Ray executor "
                              f"({spelled('--ray', 'ray_address')}).")
        if cpus_per_trial is not None:
            raise ConfigError(f"{spelled('--cpus-per-trial', 'cpus_per_trial')} applies to the "
                              f"Ray executor; locally, {spelled('--workers', 'workers')} sets "
                              f"the processes and each gets cores / workers threads.")
        workers = cpu_count() if workers is None else \
            check_int(spelled("--workers", "workers"), workers, minimum=1)
        _check_main_importable()
        return {"kind": "local", "workers": workers, "threads": threads_per_worker(workers)}
    cpus_name = spelled("--cpus-per-trial", "cpus_per_trial")
    if workers is not None:
        raise ConfigError(f"{spelled('--workers', 'workers')} applies to the local executor; "
                          f"with Ray, {cpus_name} sets each trial's share of the cluster.")
    if not isinstance(ray_address, str) or not ray_address:
        raise ConfigError(f"{spelled('--ray', 'ray_address')} must be an address, 'local' or "
                          f"'auto', got {ray_address!r}.")
    cpus = exp.threads or 1 if cpus_per_trial is None else \
        check_float(cpus_name, cpus_per_trial, positive=True)
    from attnscale.sweep.ray_exec import import_ray
    import_ray()  # fail now, before any file is written, when Ray is missing
    return {"kind": "ray", "address": ray_address, "cpus": cpus, "gpus": gpus,
            "threads": max(1, int(cpus))}


def _check_trials(exp: registry.Experiment, trials: Sequence[Trial]) -> None:
    """Validate every config up front, so a bad value fails before the first trial."""
    if exp.check is not None:
        for trial in trials:
            exp.check(dict(trial.config))


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while a record is written, so a stop never tears a line."""
    mask = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread() or \
            not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, mask)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _execute(store: Store, spec: SweepSpec, exp: registry.Experiment, executor: dict,
             retry_errors: bool, show_progress: bool | None, *, write_spec: bool,
             new: bool) -> SweepResults:
    trials = spec.trials()
    store.repair()
    latest = store.latest()
    todo = [t for t in trials if t.id not in latest
            or (retry_errors and latest[t.id]["status"] == "error")]
    if not new:  # a new sweep was checked before its folder was made
        _check_trials(exp, todo)
    if write_spec:
        store.write_spec(spec)
    configs = {t.id: t.config for t in todo}
    tasks = [Task(t.id, exp.name, exp.module, t.config, executor["threads"]) for t in todo]
    bar = progress(range(len(tasks)), desc=f"sweep {exp.name}", total=len(tasks),
                   enabled=show_progress)
    errors = 0
    key = None if exp.batch_key is None else (lambda task: exp.batch_key(dict(task.config)))

    def record(out: dict) -> None:
        nonlocal errors
        with _signals_deferred():
            store.append({**out, "config": configs[out["trial"]]})
        errors += out["status"] == "error"
        bar.update(1)
        if errors:
            bar.set_postfix_str(f"{errors} failed", refresh=False)

    try:
        if executor["kind"] == "local":
            run_local(tasks, record, workers=executor["workers"], key=key)
        else:
            from attnscale.sweep.ray_exec import run_ray
            run_ray(tasks, record, cpus=executor["cpus"], gpus=executor["gpus"], key=key)
    finally:
        store.close()
        bar.close()
    store.compact([t.id for t in trials])
    return load(store.path)
