"""Figures 1-2 data plus the variance check: attnscale vs the essay's direct numpy sampling.

Goal: the essay's settings (9 d_k values, n = 256, 2000 trials, variance at 100k pairs)
take <= 1 s in-process and run >= 20x faster than sampling q and K vectors directly in numpy.

    python benchmarks/bench_montecarlo.py            # full essay settings (baseline takes ~30 s)
    python benchmarks/bench_montecarlo.py --scale 0.1  # fewer trials/pairs for a quick look
    python benchmarks/bench_montecarlo.py --keys --trials 100  # entropy vs n keys, at init

``--keys`` times the entropy-vs-n grid of the report's keys section instead: every mechanism defined at init at d_k = 64
over n = 16, 64, ..., 65536, and prints seconds per mechanism and sampling method, to size the
report section that draws it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from attnscale.measure.montecarlo import (
    ESSAY_D_KS, ESSAY_N, ESSAY_PAIRS, ESSAY_TRIALS, saturation, variance,
)
from attnscale.mechanisms import MECHANISMS
from attnscale.report.sections.keys import KEYS_NS



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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply trials and pairs by this factor (default 1 = essay settings)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the fast path (median)")
    ap.add_argument("--keys", action="store_true",
                    help="time the entropy-vs-n grid (d_k=64, n=16..65536) per mechanism instead")
    ap.add_argument("--trials", type=int, default=100, help="trials per n for --keys")
    args = ap.parse_args()
    if args.keys:
        keys_grid(args.trials)
        return
    trials = max(2, int(ESSAY_TRIALS * args.scale))
    pairs = max(2, int(ESSAY_PAIRS * args.scale))

    variance(ESSAY_D_KS, 1000, 0)                       # warm-up (imports, allocator)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        variance(ESSAY_D_KS, pairs, 0)
        saturation(ESSAY_D_KS, ESSAY_N, trials, 0)
        times.append(time.perf_counter() - t0)
    ours = sorted(times)[len(times) // 2]

    t0 = time.perf_counter()
    direct_numpy(ESSAY_D_KS, ESSAY_N, trials, pairs)
    base = time.perf_counter() - t0

    print(f"settings: d_k={list(ESSAY_D_KS)} n={ESSAY_N} trials={trials} pairs={pairs}")
    print(f"attnscale (chi-square shortcut, median of {args.repeats}): {ours:8.3f} s"
          f"   goal <= 1 s: {'PASS' if ours <= 1.0 else 'FAIL'}")
    print(f"direct numpy sampling of q and K (essay's method):       {base:8.3f} s")
    print(f"speed-up: {base / ours:.1f}x   goal >= 20x: {'PASS' if base / ours >= 20 else 'FAIL'}")


if __name__ == "__main__":
    main()
