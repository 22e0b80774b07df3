"""The sweep engine's cost and its parallel speed-up, each against its reference in one run.

1. Engine overhead per trial (goal: local <= 50 ms): a sweep of ``--trials`` near-free
   ``saturation`` cells, against calling the trial function in a loop in this process.  Reported
   with the start-up (fork server, workers; Ray's start) and without it (a second sweep on the
   warm fork server / an already running Ray).
2. A ``study recall``-like grid on 2 workers vs 1 worker (goal >= 1.7x on 2 cores).
3. Batching: ``study recall --d-k 16,64 --seed 0`` (every mechanism, default settings) on the
   engine with 2 workers, the runs of a d_k dealt into one batched chunk per worker, against the
   old study (all runs of a d_k as one batched model in one process) and against the engine
   running one run per trial (no batching).  ``--rounds`` interleaved rounds, each order rotated,
   with the load average printed, since the machine may not be idle; about 1 minute a round.
4. ``--full-study``: the whole default ``study recall`` grid (every mechanism x 4 d_k x 3 seeds),
   before (every run of a d_k as one batched model, one process) and after (the engine, 2
   workers, batched chunks).  About 40 minutes on 2 cores; off by default.

    python benchmarks/bench_sweep.py                       # 1, 2 and 3 (about 4 minutes)
    python benchmarks/bench_sweep.py --no-ray --trials 100 --rounds 1
    python benchmarks/bench_sweep.py --only-batching --rounds 3
    python benchmarks/bench_sweep.py --full-study
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import machine
from attnscale import sweep
from attnscale.experiments.recall import RecallConfig
from attnscale.experiments import registry
from attnscale.sweep.trial import canonical_json
from attnscale.experiments.saturation import saturation_cell

OVERHEAD_LIMIT = 0.050        # seconds per trial, local executor: small beside a 1 s trial
SPEEDUP_TARGET = 1.7          # 2 workers vs 1 on 2 cores: most of the ideal 2x
BATCHED_TARGET = 1.5          # 2 workers, batched chunks vs the old 1-process study: clearly faster
TINY = {"mechanism": "scaled", "d_k": 1, "n": 2, "trials": 2}
STUDY_LIKE = {"mechanism": ["scaled", "unscaled", "qk-layernorm", "softcap"], "d_k": [16, 64],
              "seed": [0]}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def overhead(root: Path, trials: int, ray: bool) -> None:
    grid = {"seed": list(range(trials))}
    loop = _timed(lambda: [saturation_cell(**TINY, seed=s) for s in grid["seed"]])
    print(f"[overhead] {trials} near-free saturation cells; a loop in this process: "
          f"{1e3 * loop / trials:.2f} ms/trial")
    runs = [("local, cold (fork server and worker start-up)", {"workers": 1}),
            ("local, warm fork server", {"workers": 1}),
            ("local, 2 workers, warm", {"workers": 2})]
    if ray:
        runs += [("ray, starting a local instance", {"ray_address": "local"})]
    for i, (label, executor) in enumerate(runs):
        wall = _timed(lambda: sweep.run("saturation", grid, root / f"o{i}", fixed=TINY,
                                        show_progress=False, **executor))
        per = (wall - loop) / trials
        goal = ""
        if "ray_address" not in executor and i > 0:  # the goal is on the steady state
            goal = f" (goal <= {1e3 * OVERHEAD_LIMIT:.0f} ms) " + \
                ("PASS" if per <= OVERHEAD_LIMIT else "FAIL")
        print(f"  {label}: {wall:.2f} s, overhead {1e3 * per:.2f} ms/trial{goal}")
    if ray:
        import ray as ray_module
        ray_module.init(include_dashboard=False, logging_level="warning")
        try:
            wall = _timed(lambda: sweep.run("saturation", grid, root / "ray-warm", fixed=TINY,
                                            ray_address="local", show_progress=False))
        finally:
            ray_module.shutdown()
        print(f"  ray, instance already running: {wall:.2f} s, overhead "
              f"{1e3 * (wall - loop) / trials:.2f} ms/trial")


def speedup(root: Path, steps: int) -> None:
    fixed = {"steps": steps}
    n = len(STUDY_LIKE["mechanism"]) * len(STUDY_LIKE["d_k"]) * len(STUDY_LIKE["seed"])
    sweep.run("saturation", {"seed": [0, 1]}, root / "warm", fixed=TINY, workers=2,
              show_progress=False)  # start the fork server outside the timings
    one = _timed(lambda: sweep.run("recall", STUDY_LIKE, root / "w1", fixed=fixed, workers=1,
                                   show_progress=False))
    two = _timed(lambda: sweep.run("recall", STUDY_LIKE, root / "w2", fixed=fixed, workers=2,
                                   show_progress=False))
    same = [r["result"] for r in sweep.load(root / "w1")] == \
        [r["result"] for r in sweep.load(root / "w2")]
    ratio = one / two
    print(f"[speed-up] recall, {n} trials of {steps} steps: 1 worker {one:.1f} s, 2 workers "
          f"{two:.1f} s: {ratio:.2f}x (goal >= {SPEEDUP_TARGET}x) "
          f"{'PASS' if ratio >= SPEEDUP_TARGET else 'FAIL'}; identical results: {same}")


@contextlib.contextmanager
def _unbatched(experiment: str):
    """The engine without ``experiment``'s batching (the driver plans chunks, so this suffices)."""
    exp = registry.EXPERIMENTS[experiment]
    registry.EXPERIMENTS[experiment] = dataclasses.replace(exp, batch_key=None, run_batch=None)
    try:
        yield
    finally:
        registry.EXPERIMENTS[experiment] = exp


def batching(root: Path, rounds: int) -> None:
    from attnscale.experiments.recall.config import RecallConfig
    from attnscale.experiments.recall.trainer import config_dict, train_runs
    from attnscale.experiments.recall.trial import trial_result
    from attnscale.mechanisms import MECHANISMS
    d_ks, seeds = [16, 64], [0]
    grid = {"mechanism": list(MECHANISMS), "d_k": d_ks, "seed": seeds}
    n = len(MECHANISMS) * len(d_ks) * len(seeds)
    sweep.run("saturation", {"seed": [0, 1]}, root / "warm-b", fixed=TINY, workers=2,
              show_progress=False)  # start the fork server outside the timings
    old_results: dict[str, list] = {}
    stores: list[Path] = []

    def old() -> None:  # the study before the engine: each d_k one batched model, one process
        old_results["runs"] = [run for d in d_ks for run in train_runs(
            [RecallConfig(mechanism=m, d_k=d, seed=s) for m in MECHANISMS for s in seeds])]

    def engine(batched: bool) -> None:
        out = root / f"study-{len(times)}"
        with contextlib.nullcontext() if batched else _unbatched("recall"):
            sweep.run("recall", grid, out, workers=2, show_progress=False)
        if batched:
            stores.append(out)

    runs = {"old: batched, 1 process": old,
            "engine, 2 workers, batched chunks": lambda: engine(True),
            "engine, 2 workers, one run per trial": lambda: engine(False)}
    times: list[tuple[str, float]] = []
    print(f"[batching] study recall --d-k 16,64 --seed 0 ({n} runs), {rounds} interleaved "
          f"rounds; load average before: {os.getloadavg()[0]:.2f}")
    labels = list(runs)
    for r in range(rounds):
        for label in labels[r % 3:] + labels[:r % 3]:
            times.append((label, _timed(runs[label])))
    print(f"  load average after: {os.getloadavg()[0]:.2f}")
    median = {label: statistics.median(t for l, t in times if l == label) for label in labels}
    for label in labels:
        all_t = ", ".join(f"{t:.1f}" for l, t in times if l == label)
        print(f"  {label}: median {median[label]:.1f} s ({all_t}); "
              f"{median[labels[0]] / median[label]:.2f}x the old study")
    ratio = median[labels[0]] / median[labels[1]]
    by_config = {canonical_json(r["config"]): canonical_json(r["result"])
                 for r in sweep.load(stores[-1])}
    same = all(by_config[canonical_json(config_dict(run.config))] ==
               canonical_json(trial_result(run)) for run in old_results["runs"])
    print(f"  batched engine vs old study: {ratio:.2f}x (goal >= {BATCHED_TARGET}x) "
          f"{'PASS' if ratio >= BATCHED_TARGET else 'FAIL'}; results identical to the old "
          f"study's: {same}")


def full_study(root: Path) -> None:
    from dataclasses import replace

    from attnscale.experiments.recall import RecallConfig, run_all
    from attnscale.mechanisms import MECHANISMS
    from attnscale.study.recall import D_KS as STUDY_D_KS, SEEDS as STUDY_SEEDS
    grid = {"mechanism": list(MECHANISMS), "d_k": list(STUDY_D_KS), "seed": list(STUDY_SEEDS)}
    configs = [replace(RecallConfig(), mechanism=m, d_k=d, seed=s)
               for d in STUDY_D_KS for m in MECHANISMS for s in STUDY_SEEDS]
    before = _timed(lambda: run_all(configs, show_progress=False))
    after = _timed(lambda: sweep.run("recall", grid, root / "study", workers=2))
    print(f"[study recall] {len(MECHANISMS) * len(STUDY_D_KS) * len(STUDY_SEEDS)} runs: before "
          f"(batched, 1 process) {before / 60:.1f} min; after (engine, 2 workers, chunks) "
          f"{after / 60:.1f} min")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200, help="trials of the overhead sweep")
    ap.add_argument("--steps", type=int, default=1200, help="steps per recall run (speed-up)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray overhead")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the batching "
                    "comparison (0: skip it)")
    ap.add_argument("--only-batching", action="store_true", help="only the batching comparison")
    ap.add_argument("--full-study", action="store_true", help="also time the whole study")
    args = ap.parse_args()
    recall = RecallConfig()
    print(machine.describe((recall.batch_size, 1, recall.pairs, recall.d_k)))  # the recall trials
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        root = Path(tmp)
        if not args.only_batching:
            overhead(root, args.trials, ray=not args.no_ray)
            speedup(root, args.steps)
        if args.rounds:
            batching(root, args.rounds)
        if args.full_study:
            full_study(root)


if __name__ == "__main__":
    main()
