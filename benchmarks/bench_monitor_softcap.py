"""The monitor on soft-cap attention: statistics from the kernel's own logits vs recomputed.

    python benchmarks/bench_monitor_softcap.py                     # B=1, H=8, N=2048, d=64
    python benchmarks/bench_monitor_softcap.py --threads 1 --seq-len 1024 --rounds 3

Each round runs one forward of ``attnscale.attention(q, k, v, "softcap", causal=True)`` inside a
one-module model three ways, interleaved so machine load hits all alike:

* ``plain``: no monitor;
* ``monitor, kernel rows``: the monitor takes the row statistics from the blockwise soft-cap
  kernel (``Observation.request_rows``), which forms the logits anyway;
* ``monitor, recomputed``: the monitor scores q kᵀ blockwise itself (what it does on SDPA paths),
  forced by refusing ``request_rows``.

It prints the median seconds of each and the ratios to ``plain`` (medians over rounds, and
best ÷ best).  The goal for the monitored forward is <= 1.5x unmonitored at N = 2048 on
2 threads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from torch import nn

import machine

MODES = ("plain", "monitor, kernel rows", "monitor, recomputed")


class Capped(nn.Module):
    def forward(self, q, k, v):
        from attnscale.attention import attention
        return attention(q, k, v, "softcap", causal=True)


def forward(model: nn.Module, qkv, mode: str, block: int) -> None:
    from attnscale import pipeline
    from attnscale.measure.monitor import monitor

    refuse = mode == "monitor, recomputed"
    original = pipeline.Observation.request_rows
    if refuse:
        pipeline.Observation.request_rows = lambda self, sink: False
    try:
        with torch.no_grad(), (monitor(model, block=block) if mode != "plain" else nullcontext()):
            model(*qkv)
    finally:
        pipeline.Observation.request_rows = original


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="N (default 2048)")
    parser.add_argument("--heads", type=int, default=8, help="H (default 8)")
    parser.add_argument("--batch", type=int, default=1, help="B (default 1)")
    parser.add_argument("--d-head", type=int, default=64, help="d (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--block", type=int, default=128, help="monitor block (default 128)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(args.batch, args.heads, args.seq_len, args.d_head, generator=gen)
           for _ in range(3)]
    model = Capped()
    print(f"softcap, causal, B={args.batch}, H={args.heads}, N={args.seq_len}, d={args.d_head}, "
          f"float32, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(machine.describe(tuple(qkv[0].shape), causal=True))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up
        forward(model, qkv, mode, args.block)
    for _ in range(args.rounds):
        for mode in MODES:
            t0 = time.perf_counter()
            forward(model, qkv, mode, args.block)
            times[mode].append(time.perf_counter() - t0)
    plain = statistics.median(times["plain"])
    for mode in MODES:
        med = statistics.median(times[mode])
        print(f"{mode:22s} median {med * 1e3:8.1f} ms   ratio {med / plain:5.2f} (median)  "
              f"{min(times[mode]) / min(times['plain']):5.2f} (best/best)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
