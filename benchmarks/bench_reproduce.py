"""``attnscale reproduce``: CPU time of each report section, and the whole command on one process
against its sections side by side (``--workers 2``, :mod:`attnscale.report.parallel`).

Goal: the whole report within 30 s of wall time on an idle 2-core machine, with every claim at
its sample size.  Each section runs in a fresh subprocess (so imports and caches are its own) at
the thread count it gets in each mode: the machine's default when it runs in the calling process,
one thread in a worker of a 2-worker report.  Its CPU seconds count every process it starts (the
recall section trains in sweep workers): this script samples the CPU time of the subprocess's
whole process tree from ``/proc`` every 0.1 s.

On an idle 2-core machine ``--workers 2`` keeps both cores busy: the driver runs Monte Carlo
sections while the report worker's fork server imports attnscale, then the recall section, whose
demo trains on one sweep worker while its other stores train on a second one beside it, and the
report worker runs the remaining Monte Carlo sections; so its wall time is about the driver's
start (imports) plus half the CPU seconds of everything after it, but no less than the demo's
training.  That estimate ("two busy cores") is printed with the section table, because wall
times on a machine shared with other work mean little (the load average is printed with every
figure).  The whole command is then timed in interleaved rounds of ``--workers 1`` and
``--workers 2``: wall seconds and the CPU seconds of every process, the median and best of
each, best ÷ best, and the two reports' ``report.md`` compared byte for byte.

    python benchmarks/bench_reproduce.py                 # sections, then 2 rounds of the command
    python benchmarks/bench_reproduce.py --sections-only
    python benchmarks/bench_reproduce.py --command-only --rounds 3
    python benchmarks/bench_reproduce.py --full --sections-only   # the --full form's sections
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
threads, full = int(sys.argv[2]), sys.argv[3] == "1"
if threads:
    torch.set_num_threads(threads)
fn = SECTIONS[int(sys.argv[1])]
t0, w0 = time.process_time(), time.perf_counter()
if __name__ == "__main__":
    section = fn(Path(tempfile.mkdtemp()), seed=0, full=full)
    print(json.dumps({"section": section.name, "cpu_self": time.process_time() - t0,
                      "wall": time.perf_counter() - w0, "threads": torch.get_num_threads()}))
"""
TICK = os.sysconf("SC_CLK_TCK")
POLL = 0.1  # seconds between samples of the process tree


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, user + system CPU seconds, start time in clock ticks) of a live process,
    else None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, int(fields[19])


def run_tree(argv: list[str], report_workers: int = 0) -> dict:
    """Run ``argv``; its wall seconds, stdout, and the CPU seconds of every process of its tree
    (itself and its descendants, each read at its last sample: a process that lives less than
    POLL seconds may be missed).  ``lanes`` splits the CPU of a report run with
    ``report_workers`` worker processes by process role (see :func:`_lanes`)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen: dict[int, tuple[int, float, int]] = {}   # pid -> its last (parent, cpu, start)
    while proc.poll() is None:
        stats = {int(e): s for e in os.listdir("/proc") if e.isdigit()
                 if (s := _stat(int(e))) is not None}
        tree, grew = {proc.pid}, True
        while grew:
            new = {pid for pid, (parent, *_) in stats.items() if parent in tree} - tree
            tree |= new
            grew = bool(new)
        for pid in tree & stats.keys():
            seen[pid] = stats[pid]
        time.sleep(POLL)
    wall = time.perf_counter() - t0
    out = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"{argv} exited {proc.returncode}")
    cpu = {pid: c for pid, (_, c, _) in seen.items()}
    return {"wall": wall, "cpu": sum(cpu.values()), "children": sum(cpu.values()) - cpu.get(
        proc.pid, 0.0), "processes": len(cpu), "stdout": out,
            "lanes": _lanes(proc.pid, seen, report_workers)}


def _lanes(root: int, seen: dict[int, tuple[int, float, int]],
           report_workers: int) -> dict[str, float]:
    """CPU seconds of a report by role: the driver process (its imports, Monte Carlo sections
    while the fork server starts, the recall section's analysis), the fork server (its imports),
    the report workers (the fork server's first ``report_workers`` children: Monte Carlo
    sections) and the sweep workers (its later children: the recall section's training)."""
    forkserver = [pid for pid, (parent, *_) in seen.items() if parent == root
                  and any(p == pid for p, *_ in seen.values())]
    lanes = {"driver": seen[root][1], "fork server": 0.0, "report worker": 0.0,
             "sweep workers": 0.0}
    if forkserver:
        fs = max(forkserver, key=lambda pid: sum(p == pid for p, *_ in seen.values()))
        lanes["fork server"] = seen[fs][1]
        kids = sorted((start, pid) for pid, (parent, _, start) in seen.items() if parent == fs)
        for i, (_, pid) in enumerate(kids):
            lanes["report worker" if i < report_workers else "sweep workers"] += seen[pid][1]
    return lanes


LANE = """
import sys, tempfile
import torch
from attnscale.report.parallel import _threads
from attnscale.report.reproduce import REPRODUCE_WORKERS, SECTIONS, reproduce
lane = SECTIONS[-1:] if sys.argv[1] == "driver" else SECTIONS[:-1]
if sys.argv[1] == "worker":   # the thread count a report worker gives its sections
    torch.set_num_threads(_threads(REPRODUCE_WORKERS))
if __name__ == "__main__":
    reproduce(tempfile.mkdtemp(), 0, sections=lane, workers=1,
              **({"full": True} if sys.argv[2] == "1" else {}))
"""


def lanes(full: bool) -> dict[str, float]:
    """CPU seconds of each lane of a 2-worker report run alone, start included: the driver's
    (the recall section, on two sweep workers) and the worker's (the Monte Carlo sections in a
    row, on one process)."""
    out = {}
    for lane in ("driver", "worker"):
        load = machine.load()
        r = run_tree([sys.executable, "-c", LANE, lane, str(int(full))])
        out[lane] = r["cpu"]
        print(f"{lane} lane ({'recall' if lane == 'driver' else 'Monte Carlo'}): {r['cpu']:.1f} s "
              f"CPU in {r['processes']} processes, {r['wall']:.1f} s wall; before: {load}",
              flush=True)
    print(f"idle estimate of --workers 2 on two busy cores: {sum(out.values()) / 2:.1f} s "
          "(half the two lanes' CPU; each counts a start of its own, one more than the report)")
    return out


def sections(full: bool) -> None:
    from attnscale.report.reproduce import SECTIONS
    print(f"{'section':58s} {'threads':>7s} {'cpu s':>7s} {'wall s':>7s}  load (1 5 15 min)")
    lanes = {"worker": 0.0, "driver": 0.0}
    for i in range(len(SECTIONS)):
        for threads in (0, 1):  # 0: the default count
            r = run_tree([sys.executable, "-c", SECTION, str(i), str(threads), str(int(full))])
            res = json.loads(r["stdout"].strip().splitlines()[-1])
            cpu = res["cpu_self"] + r["children"]   # the section's own work and its workers'
            print(f"{res['section'][:58]:58s} {res['threads']:7d} {cpu:7.2f} "
                  f"{res['wall']:7.2f}  {' '.join(f'{v:.2f}' for v in os.getloadavg())}",
                  flush=True)
            if threads == 1:   # a 2-worker report: the last section in the driver, one thread
                lanes["driver" if i == len(SECTIONS) - 1 else "worker"] += cpu
    print(f"sections of --workers 2: recall {lanes['driver']:.1f} s, Monte Carlo "
          f"{lanes['worker']:.1f} s of CPU; on two busy cores about "
          f"{(lanes['driver'] + lanes['worker']) / 2:.1f} s plus the start; {machine.load()}")


def command(rounds: int, full: bool) -> None:
    times: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        reports = {}
        for rnd in range(rounds):
            for workers in (1, 2) if rnd % 2 == 0 else (2, 1):   # interleaved, alternating
                out = Path(tmp) / f"workers{workers}"
                load = machine.load()
                r = run_tree([sys.executable, "-m", "attnscale", "reproduce", "--out", str(out),
                              "--workers", str(workers), "--force", *(["--full"] * full)],
                             report_workers=workers - 1)
                times[workers].append(r)
                reports[workers] = (out / "report.md").read_bytes()
                lanes = ", ".join(f"{k} {v:.1f}" for k, v in r["lanes"].items())
                print(f"round {rnd + 1}: reproduce --workers {workers}: {r['wall']:6.1f} s wall, "
                      f"{r['cpu']:6.1f} s CPU in {r['processes']} processes ({lanes}); "
                      f"before: {load}", flush=True)
        for workers, rs in times.items():
            walls = [r["wall"] for r in rs]
            print(f"--workers {workers}: wall median {statistics.median(walls):.1f} s, best "
                  f"{min(walls):.1f} s; CPU median {statistics.median(r['cpu'] for r in rs):.1f} s")
        print(f"best ÷ best, --workers 1 over --workers 2: "
              f"{min(r['wall'] for r in times[1]) / min(r['wall'] for r in times[2]):.2f}; "
              f"{machine.load()}")
        print("report.md identical:", reports[1] == reports[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--sections-only", action="store_true", help="skip the whole command")
    only.add_argument("--command-only", action="store_true", help="skip the section table")
    only.add_argument("--lanes-only", action="store_true",
                      help="only the two lanes of a 2-worker report, each run alone")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the command")
    ap.add_argument("--full", action="store_true", help="time reproduce --full")
    args = ap.parse_args()
    recall = RecallConfig()
    print(machine.describe((recall.batch_size, 1, recall.pairs, recall.d_k)))  # the recall sections
    print(machine.load(), "(other agents share this machine: see the load with each figure)")
    if args.lanes_only:
        lanes(args.full)
        return
    if not args.command_only:
        sections(args.full)
        lanes(args.full)
    if not args.sections_only:
        command(args.rounds, args.full)


if __name__ == "__main__":
    main()
