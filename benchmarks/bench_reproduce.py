"""``attnscale reproduce``: CPU time of each report section, and the whole command on one process
against its sections side by side (``--workers 2``, :mod:`attnscale.report.parallel`).

Goal: the whole report within 30 s of wall time on an idle 2-core machine, with every claim at
its sample size.  Each section runs in a fresh subprocess (so imports and caches are its own),
timed with ``time.process_time`` (CPU seconds of that process, all its threads) at the thread
count it gets in each mode: the machine's default when it runs in the calling process, one thread
in a worker of a 2-worker report.  The whole command is timed in wall seconds (its worker
processes are forked by a fork server, so no rusage of this process sees their CPU), and the
two reports' ``report.md`` are compared byte for byte.

    python benchmarks/bench_reproduce.py                 # sections, then the whole command
    python benchmarks/bench_reproduce.py --sections-only

Wall times on a machine shared with other work mean little; the CPU seconds are steadier.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine
from attnscale.experiments.recall import RecallConfig

SECTION = """
import json, sys, tempfile, time
from pathlib import Path
import torch
from attnscale.report.reproduce import SECTIONS
threads = int(sys.argv[2])
if threads:
    torch.set_num_threads(threads)
fn = SECTIONS[int(sys.argv[1])]
t0, w0 = time.process_time(), time.perf_counter()
section = fn(Path(tempfile.mkdtemp()), seed=0)
print(json.dumps({"section": section.name, "cpu": time.process_time() - t0,
                  "wall": time.perf_counter() - w0, "threads": torch.get_num_threads()}))
"""


def _sections() -> None:
    from attnscale.report.reproduce import SECTIONS
    print(f"{'section':58s} {'threads':>7s} {'cpu s':>7s} {'wall s':>7s}")
    for i in range(len(SECTIONS)):
        for threads in (0, 1):  # 0: the default count
            out = subprocess.run([sys.executable, "-c", SECTION, str(i), str(threads)],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{r['section'][:58]:58s} {r['threads']:7d} {r['cpu']:7.2f} {r['wall']:7.2f}",
                  flush=True)


def _command(workers: int, out: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attnscale", "reproduce", "--out", str(out),
                    "--workers", str(workers)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections-only", action="store_true", help="skip the whole command")
    args = ap.parse_args()
    recall = RecallConfig()
    print(machine.describe((recall.batch_size, 1, recall.pairs, recall.d_k)))  # the recall sections
    print(machine.load())
    _sections()
    if args.sections_only:
        return
    with tempfile.TemporaryDirectory() as tmp:
        reports = {}
        for workers in (1, 2):
            out = Path(tmp) / f"workers{workers}"
            wall = _command(workers, out)
            reports[workers] = (out / "report.md").read_bytes()
            print(f"reproduce --workers {workers}: {wall:6.1f} s wall", flush=True)
        print("report.md identical:", reports[1] == reports[2])


if __name__ == "__main__":
    main()
