"""The sweep engine's cost and its parallel speed-up, each against its reference in one run.

1. Engine overhead per trial (issue 11: local <= 50 ms): a sweep of ``--trials`` near-free
   ``saturation`` cells, against calling the trial function in a loop in this process.  Reported
   with the start-up (fork server, workers; Ray's start) and without it (a second sweep on the
   warm fork server / an already running Ray).
2. A ``study recall``-like grid on 2 workers vs 1 worker (goal >= 1.7x on 2 cores).
3. ``--full-study``: the whole default ``study recall`` grid (13 mechanisms x 4 d_k x 3 seeds),
   before (every run of a d_k as one batched model, one process) and after (one run per trial on
   the engine, 2 workers).  About an hour on 2 cores; off by default.

    python benchmarks/bench_sweep.py                       # 1 and 2 (about 2 minutes)
    python benchmarks/bench_sweep.py --no-ray --trials 100
    python benchmarks/bench_sweep.py --full-study
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from attnscale import sweep
from attnscale.measure.saturation_trial import saturation_cell

OVERHEAD_LIMIT = 0.050        # seconds per trial, local executor (issue 11)
SPEEDUP_TARGET = 1.7          # 2 workers vs 1 (issue 11)
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


def full_study(root: Path) -> None:
    from attnscale.experiments.recall.experiments import STUDY_D_KS, STUDY_SEEDS, study
    from attnscale.mechanisms import MECHANISMS
    grid = {"mechanism": list(MECHANISMS), "d_k": list(STUDY_D_KS), "seed": list(STUDY_SEEDS)}
    before = _timed(lambda: study(show_progress=False))
    after = _timed(lambda: sweep.run("recall", grid, root / "study", workers=2))
    print(f"[study recall] {len(MECHANISMS) * len(STUDY_D_KS) * len(STUDY_SEEDS)} runs: before "
          f"(batched, 1 process) {before / 60:.1f} min; after (engine, 2 workers) "
          f"{after / 60:.1f} min")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200, help="trials of the overhead sweep")
    ap.add_argument("--steps", type=int, default=1200, help="steps per recall run (speed-up)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray overhead")
    ap.add_argument("--full-study", action="store_true", help="also time the whole study")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        root = Path(tmp)
        overhead(root, args.trials, ray=not args.no_ray)
        speedup(root, args.steps)
        if args.full_study:
            full_study(root)


if __name__ == "__main__":
    main()
