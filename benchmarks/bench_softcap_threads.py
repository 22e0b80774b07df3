"""Soft-cap forward + backward on 1 and 2 threads, three ways of using the threads, against SDPA.

    python benchmarks/bench_softcap_threads.py                  # B=4, H=8, N=1024, d=64, 7 rounds
    python benchmarks/bench_softcap_threads.py --rounds 15 --threads 1,2,4

The blockwise soft-cap kernel runs its head groups on worker threads (attnscale.workers).  Soft-cap on
2 threads was once no faster than on 1, while SDPA gained 1.4x; the cause was each
worker's torch ops opening an OpenMP team of torch.get_num_threads() threads, so 2 workers ran 4
spinning threads on 2 cores.  The variants, timed interleaved in one process, round by round:

* ``workers``: attnscale's pool, each worker's torch ops on one intra-op thread (the fix);
* ``workers+omp``: the same pool without that setting (the old behaviour: an OpenMP team per
  worker);
* ``serial``: no workers; the blocks run one after another, each torch op on all threads.

Each row gives the best and median time, best ÷ best SDPA at the same thread count, and the
median over rounds of time ÷ that round's SDPA time.  The goal: ``workers`` on 2 threads
at least as fast as on 1, and <= 1.5x SDPA.  Run it on an otherwise idle machine: on a loaded one,
a variant with more threads wins a larger share of the cores from other processes.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

import machine
from attnscale import workers
from attnscale.errors import parse_int_list
from attnscale.kernels import native
from attnscale.kernels import softcap as softcap_kernel
from attnscale.mechanisms import build_mechanism

VARIANTS = ("sdpa", "workers", "workers+omp", "serial")


@functools.lru_cache(maxsize=8)
def _omp_team_pool(n: int, pid: int) -> ThreadPoolExecutor:
    """The old pool: plain threads whose torch ops open OpenMP teams of their own."""
    return ThreadPoolExecutor(max_workers=n)


def _use(variant: str) -> None:
    """Point the soft-cap kernel's thread use at ``variant``."""
    workers._pool = _omp_team_pool if variant == "workers+omp" else _ONE_THREAD_POOL
    softcap_kernel.workers_for = (lambda device, pieces: 1) if variant == "serial" \
        else workers.workers_for


_ONE_THREAD_POOL = workers._pool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--shape", default="4,8,1024,64", help="B,H,N,d (default 4,8,1024,64)")
    parser.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    args = parser.parse_args(argv)
    b, h, n, d = (int(x) for x in args.shape.split(","))
    counts = parse_int_list("--threads", args.threads)
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(b, h, n, d, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mech = build_mechanism("softcap", d, h)

    def step(variant: str) -> float:
        _use(variant)
        t0 = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v) if variant == "sdpa" else mech(q, k, v)
        torch.autograd.grad(out, (q, k, v), g)
        return time.perf_counter() - t0

    times = {(t, var): [] for t in counts for var in VARIANTS}
    for t in counts:  # warm-up: pools, kernels
        torch.set_num_threads(t)
        for var in VARIANTS:
            step(var)
    for _ in range(args.rounds):
        for t in counts:
            torch.set_num_threads(t)
            for var in VARIANTS:
                times[t, var].append(step(var))
    _use("workers")

    print(f"B,H,N,d = {(b, h, n, d)}, float32, torch {torch.__version__}, compiled kernels: "
          f"{native.isa() or 'no'}, {args.rounds} rounds, forward + backward")
    print(machine.describe((b, h, n, d), causal=True))
    print(f"{'threads':>7}  {'variant':<12}{'best ms':>9}{'median ms':>11}{'best÷best':>11}"
          f"{'median ÷':>10}")
    for t in counts:
        sdpa = times[t, "sdpa"]
        for var in VARIANTS:
            ts = times[t, var]
            ratio = statistics.median(x / s for x, s in zip(ts, sdpa))
            print(f"{t:>7}  {var:<12}{min(ts) * 1e3:>9.0f}{statistics.median(ts) * 1e3:>11.0f}"
                  f"{min(ts) / min(sdpa):>11.2f}{ratio:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
