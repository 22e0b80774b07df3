"""Figures 1-2 data plus the variance check: attnscale vs the essay's direct numpy sampling.

Goals: the essay's settings (9 d_k values, n = 256, 2000 trials, variance at 100k pairs) take
<= 1 s in-process and run >= 200x faster than sampling q and K vectors directly in numpy.

    python benchmarks/bench_montecarlo.py              # essay settings, 1 and 2 threads, 3 rounds
    python benchmarks/bench_montecarlo.py --threads 1 --rounds 5
    python benchmarks/bench_montecarlo.py --scale 0.1  # fewer trials/pairs for a quick look
    python benchmarks/bench_montecarlo.py --keys --trials 100  # entropy vs n keys, at init

Each round runs the baseline once and attnscale ``--repeats`` times (its round time is their
median), alternating which goes first, so machine load hits both alike; the ratio is the median
over rounds of baseline ÷ attnscale, and best ÷ best the fastest baseline over the fastest
attnscale run.  ``--threads`` sets torch's threads (attnscale runs its cells side by side on
them) and numpy's BLAS threads (through threadpoolctl where installed) alike.

``--keys`` times the entropy-vs-n grid of the report's keys section instead: every mechanism
defined at init at d_k = 64 over n = 16, 64, ..., 65536, and prints seconds per mechanism and
sampling method, to size the report section that draws it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np
import torch

import machine
from attnscale.measure.montecarlo import (
    ESSAY_D_KS, ESSAY_N, ESSAY_PAIRS, ESSAY_TRIALS, saturation, variance,
)
from attnscale.mechanisms import MECHANISMS
from attnscale.report.sections.keys import KEYS_NS

SPEED_GOAL = 200.0    # attnscale at least this many times faster than direct sampling
SECONDS_GOAL = 1.0    # and the essay's settings within this many seconds


def direct_numpy(d_ks, n, trials, pairs, seed=0, chunk=1 << 23):
    """The essay's method: sample q and K explicitly, softmax and statistics in numpy."""
    rng = np.random.default_rng(seed)
    out = []
    for d_k in d_ks:
        # Variance: q.k for `pairs` explicit Gaussian pairs.
        per = max(1, chunk // d_k)
        dots = []
        for start in range(0, pairs, per):
            m = min(per, pairs - start)
            q = rng.standard_normal((m, d_k))
            k = rng.standard_normal((m, d_k))
            dots.append(np.einsum("ij,ij->i", q, k))
        std = np.concatenate(dots).std(ddof=1)
        # Saturation: one query against n keys per trial, scaled and unscaled.
        per = max(1, chunk // (n * d_k))
        sums = np.zeros((2, 3))
        for start in range(0, trials, per):
            m = min(per, trials - start)
            q = rng.standard_normal((m, d_k, 1))
            keys = rng.standard_normal((m, n, d_k))
            raw = (keys @ q)[..., 0]                                   # (m, n)
            for j, z in enumerate((raw / np.sqrt(d_k), raw)):
                z = z - z.max(axis=-1, keepdims=True)
                p = np.exp(z)
                p /= p.sum(axis=-1, keepdims=True)
                logp = np.log(np.maximum(p, 1e-300))
                s2 = (p * p).sum(-1)
                jac = np.sqrt(np.maximum(s2 - 2 * (p ** 3).sum(-1) + s2 * s2, 0.0))
                sums[j] += [p.max(-1).sum(), (-(p * logp).sum(-1)).sum(), jac.sum()]
        out.append((d_k, std, sums / trials))
    return out


def keys_grid(trials: int) -> None:
    """Seconds of saturation(d_k=64, n=KEYS_NS) per mechanism defined at init."""
    for name, cls in MECHANISMS.items():
        if not cls.defined_at_init:
            continue
        t0 = time.perf_counter()
        rows = saturation([64], KEYS_NS, trials, 0, [name])
        print(f"{name:14s} {rows[0]['method']:15s} {time.perf_counter() - t0:8.2f} s "
              f"({trials} trials x {len(KEYS_NS)} n)")


def blas_threads(threads: int):
    """numpy's BLAS limited to ``threads`` for the block (threadpoolctl), or nothing to limit."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(threads)


def ours(trials: int, pairs: int) -> tuple[float, float, float]:
    """Seconds of attnscale's variance check and saturation at the essay's grid, and the CPU
    seconds of both (all threads)."""
    c0, t0 = time.process_time(), time.perf_counter()
    variance(ESSAY_D_KS, pairs, 0)
    t1 = time.perf_counter()
    saturation(ESSAY_D_KS, ESSAY_N, trials, 0)
    return t1 - t0, time.perf_counter() - t1, time.process_time() - c0


def measure(threads: int, trials: int, pairs: int, rounds: int, repeats: int) -> dict:
    """Interleaved rounds at ``threads`` threads: every time, in seconds."""
    torch.set_num_threads(threads)
    fast, base = [], []       # fast: per round, (variance, saturation, CPU) per repeat
    base_cpu = []
    with blas_threads(threads):
        ours(trials, pairs)               # warm-up (imports, allocator, worker threads)
        for r in range(rounds):
            for which in (("ours", "base") if r % 2 == 0 else ("base", "ours")):
                if which == "ours":
                    fast.append([ours(trials, pairs) for _ in range(repeats)])
                else:
                    c0, t0 = time.process_time(), time.perf_counter()
                    direct_numpy(ESSAY_D_KS, ESSAY_N, trials, pairs)
                    base.append(time.perf_counter() - t0)
                    base_cpu.append(time.process_time() - c0)
    per_round = [statistics.median(v + s for v, s, _ in rnd) for rnd in fast]
    cpu_round = [statistics.median(c for _, _, c in rnd) for rnd in fast]
    every = [v + s for rnd in fast for v, s, _ in rnd]
    return {"threads": threads, "ours_median": statistics.median(per_round),
            "ours_best": min(every), "base_median": statistics.median(base),
            "base_best": min(base),
            "variance_median": statistics.median(v for rnd in fast for v, _, _ in rnd),
            "saturation_median": statistics.median(s for rnd in fast for _, s, _ in rnd),
            "ratio_median": statistics.median(b / o for b, o in zip(base, per_round)),
            "ratio_best": min(base) / min(every),
            "ratio_cpu": statistics.median(b / o for b, o in zip(base_cpu, cpu_round))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply trials and pairs by this factor (default 1 = essay settings)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="attnscale runs per round (default 5; the round takes their median)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (1,2)")
    ap.add_argument("--keys", action="store_true",
                    help="time the entropy-vs-n grid (d_k=64, n=16..65536) per mechanism instead")
    ap.add_argument("--trials", type=int, default=100, help="trials per n for --keys")
    args = ap.parse_args()
    print(machine.describe())
    if args.keys:
        keys_grid(args.trials)
        return
    trials = max(2, int(ESSAY_TRIALS * args.scale))
    pairs = max(2, int(ESSAY_PAIRS * args.scale))
    print(f"settings: d_k={list(ESSAY_D_KS)} n={ESSAY_N} trials={trials} pairs={pairs}; "
          f"{args.rounds} interleaved rounds, attnscale {args.repeats}x a round")
    print(f"before: {machine.load()}")
    rows = [measure(int(t), trials, pairs, args.rounds, args.repeats)
            for t in args.threads.split(",")]
    print(f"after:  {machine.load()}")
    print(f"\n{'threads':>7}{'attnscale s':>13}{'(variance':>11}{'saturation)':>12}"
          f"{'direct s':>10}{'ratio':>8}{'best÷best':>11}{'CPU s ratio':>13}")
    for r in rows:
        print(f"{r['threads']:>7}{r['ours_median']:>13.3f}{r['variance_median']:>11.3f}"
              f"{r['saturation_median']:>12.3f}{r['base_median']:>10.2f}"
              f"{r['ratio_median']:>7.0f}x{r['ratio_best']:>10.0f}x{r['ratio_cpu']:>12.0f}x")
    print("ratio: median over rounds of direct ÷ attnscale (wall); best÷best: fastest of each; "
          "CPU s ratio: the same in CPU seconds of all threads, which other load disturbs less")
    worst = min(min(r["ratio_median"], r["ratio_best"]) for r in rows)
    slowest = max(r["ours_median"] for r in rows)
    print(f"goal >= {SPEED_GOAL:.0f}x: {'PASS' if worst >= SPEED_GOAL else 'FAIL'} (lowest "
          f"{worst:.0f}x); goal <= {SECONDS_GOAL:.0f} s: "
          f"{'PASS' if slowest <= SECONDS_GOAL else 'FAIL'} ({slowest:.3f} s)")


if __name__ == "__main__":
    main()
