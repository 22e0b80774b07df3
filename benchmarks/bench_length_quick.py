"""Wall time of ``attnscale study length --quick`` on this machine (goal: within 15 minutes on
2 cores, so the quick study fits a coffee break on a laptop), and of each of its trials.

    python benchmarks/bench_length_quick.py                  # --workers 2 into a fresh tmp folder
    taskset -c 0,1 python benchmarks/bench_length_quick.py   # pinned to 2 cores
    python benchmarks/bench_length_quick.py --out /tmp/lenq --workers 2

Prints the total wall time, then per experiment and mechanism the trial wall times (from the
stores' records) and the study's claims.  The folder is left for ``attnscale reproduce --include``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="study folder (default: a new temporary folder)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    import machine
    from attnscale import sweep
    from attnscale.study import STUDIES, launcher
    study = STUDIES["length"]
    out = args.out or tempfile.mkdtemp(prefix="attnscale-length-quick-")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    start = time.perf_counter()
    result = launcher.run(study, out, quick=True, workers=args.workers, show_progress=False)
    wall = time.perf_counter() - start
    print(f"study length --quick: {wall:.0f} s on {cores} core(s), --workers {args.workers}, "
          f"load average at the end {os.getloadavg()[0]:.1f}; folder {out}")
    print(machine.describe((16, 2, 128, 32), causal=True))  # the quick LM: width 64, 2 heads
    for store, path in launcher.store_paths(study, out).items():
        times: dict[str, list[float]] = {}
        for r in sweep.load(path).ok:
            times.setdefault(r["config"]["mechanism"], []).append(r["wall_seconds"])
        for mech, ts in times.items():
            print(f"  {store:14s} {mech:14s} " + " ".join(f"{t:6.1f}s" for t in ts))
    for c in result.analysis.claims:
        ci = "" if c["ci"] is None else f" [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}]"
        ours = "n/a" if c["ours"] is None else f"{c['ours']:.3f}"
        print(f"{c['quantity']}: {ours}{ci} -> {c['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
