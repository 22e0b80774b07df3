"""Recall training throughput: attnscale's trainer vs a straightforward PyTorch loop, side by side.

Goals: training throughput >= 5x a straightforward implementation of the same model at
the same batch size and number of steps, and the essay's scaled-vs-unscaled comparison at default
settings in <= 15 s on a 2-core CPU.

The reference is the plain loop anyone would write: per step, embed every token, project it with
W_Q, W_K, W_V, attend, read out, backward, ``torch.optim.Adam`` with its defaults; one model at a
time (:meth:`attnscale.experiments.recall.model.RecallNet.forward` is exactly that forward).  attnscale trains
both models at once on projected embedding tables with a fused Adam; see
:mod:`attnscale.experiments.recall.model`.

    python benchmarks/bench_recall.py               # 200 steps per model, then the default demo
    python benchmarks/bench_recall.py --steps 100 --skip-default
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import machine
from attnscale.experiments.recall import RecallConfig, compare, train_runs
from attnscale.experiments.recall.model import RecallNet
from attnscale.experiments.recall.task import CHUNK_STEPS, train_chunk
from attnscale.experiments.recall.trainer import TRAIN_THREADS, num_threads

MECHANISMS = ("scaled", "unscaled")
TARGET_RATIO = 5.0
TARGET_SECONDS = 15.0


def naive_train(config: RecallConfig, threads: int) -> tuple[float, list[float]]:
    """Train one model the straightforward way; return (seconds, per-step losses)."""
    with num_threads(threads):
        start = time.perf_counter()
        net = RecallNet(config)
        opt = torch.optim.Adam(net.parameters(), lr=config.lr)
        losses = []
        for t in range(config.steps):
            if t % CHUNK_STEPS == 0:
                chunk = train_chunk(config, t // CHUNK_STEPS)
            loss = net(chunk[t % CHUNK_STEPS]).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return time.perf_counter() - start, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="steps per model (default 200)")
    ap.add_argument("--skip-default", action="store_true",
                    help="skip timing the default comparison")
    args = ap.parse_args()
    base = replace(RecallConfig(), steps=args.steps)
    print(f"d_k={base.d_k} d_model={base.d_model} batch={base.batch_size} steps={args.steps} "
          f"models={','.join(MECHANISMS)}; attnscale trains on {TRAIN_THREADS} thread(s)")
    print(machine.describe((base.batch_size, 1, base.pairs, base.d_k)))

    naive = {}
    for threads in sorted({TRAIN_THREADS, torch.get_num_threads()}):
        secs, curves = zip(*(naive_train(replace(base, mechanism=m), threads) for m in MECHANISMS))
        naive[threads] = sum(secs)
        print(f"  straightforward, {threads} thread(s): {naive[threads]:7.2f} s  "
              f"({1e3 * naive[threads] / (args.steps * len(MECHANISMS)):.2f} ms per model-step)")

    start = time.perf_counter()
    one = [train_runs([replace(base, mechanism=m)], show_progress=False)[0] for m in MECHANISMS]
    fast_single = time.perf_counter() - start
    start = time.perf_counter()
    both = train_runs([replace(base, mechanism=m) for m in MECHANISMS], show_progress=False)
    fast = time.perf_counter() - start
    print(f"  attnscale, one model per run:   {fast_single:7.2f} s")
    print(f"  attnscale, both in one batch:   {fast:7.2f} s  (includes the 2000-sequence eval)")
    gap = max(abs(a - b) / b for r, n in zip(both, curves) for a, b in zip(r.loss[:5], n[:5]))
    print(f"  first 5 losses, fast vs straightforward: max relative gap {gap:.1e}")
    best_naive = min(naive.values())
    ratio = best_naive / fast
    print(f"THROUGHPUT RATIO (fastest straightforward / attnscale batched): {ratio:.1f}x "
          f"[goal >= {TARGET_RATIO:g}x: {'met' if ratio >= TARGET_RATIO else 'NOT met'}]; "
          f"unbatched {best_naive / fast_single:.1f}x")
    del one

    if not args.skip_default:
        start = time.perf_counter()
        runs = compare(MECHANISMS, show_progress=False)
        wall = time.perf_counter() - start
        print(f"DEFAULT COMPARISON ({RecallConfig().steps} steps, batch {RecallConfig().batch_size}):"
              f" {wall:.1f} s [goal <= {TARGET_SECONDS:g} s: "
              f"{'met' if wall <= TARGET_SECONDS else 'NOT met'}]")
        for r in runs:
            print(f"  {r.mechanism:9s} steps to 1.0: {r.steps_to_loss_1}, to 0.1: "
                  f"{r.steps_to_loss_0_1}, final {r.final_loss:.5f}, accuracy {r.eval_accuracy:.4f}")


if __name__ == "__main__":
    main()
