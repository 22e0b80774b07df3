"""Cost of ``attnscale.monitor`` on a tiny random Llama, side by side with its references.

    python benchmarks/bench_monitor.py                  # hidden 256, 4 layers, 4 heads, B=1, N=2048
    python benchmarks/bench_monitor.py --rounds 3 --seq-len 1024

Time: each round runs one forward of the same ``attn_implementation="attnscale"`` model without
and with the monitor, interleaved so machine load hits both alike; the ratio is the median over
rounds of monitored ÷ unmonitored (also in process CPU time, on 1 thread the work itself).  Goal:
<= 1.2.  By default the monitored softmax calls run on attnscale's blockwise softmax kernel, which
forms the logits once for the output and the statistics (:mod:`attnscale.kernels.softmax_rows`);
the same rounds also time ``exact_outputs=True`` (SDPA as unmonitored, and q kᵀ scored a second
time beside it for the compiled row-statistics kernel, :mod:`attnscale.kernels.rowstats`) and that
on the PyTorch formulation (what runs where the kernel could not be built), for context.

Memory: the peak extra memory of one forward, for the model on ``"attnscale"`` (plain and
monitored) and on ``"eager"`` with ``output_attentions=True`` (how one measures entropies without
the monitor).  Each is measured in a fresh process: after a short warm-up forward, the peak RSS is
reset to the current RSS (``/proc/self/clear_refs``), one forward runs, and the growth of the peak
over that baseline is reported.  glibc is told to serve every allocation of 64 KiB or more with its
own mmap (``MALLOC_MMAP_THRESHOLD_``), so a tensor freed earlier cannot hide in already-resident
heap pages: the growth counts every large tensor alive at the peak.  The base ``LlamaModel`` is
used (no LM head), so the vocabulary does not pad either side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import machine

GOAL = 1.2
MODES = ("attnscale", "attnscale+monitor", "eager+output_attentions")
TORCH_STATS = "attnscale+monitor, PyTorch stats"
EXACT = "attnscale+monitor, exact outputs"


def build(seq_len: int, attn: str, seed: int = 0):
    """A tiny random Llama (the monitor tests' model) and (1, N) token ids."""
    import transformers

    from attnscale import hf

    hf.register()
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=max(seq_len, 2048))
    torch.manual_seed(seed)
    model = transformers.LlamaModel(cfg).eval()
    model.set_attn_implementation(attn)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    return model, ids


def use_compiled_kernel(on: bool) -> None:
    """Switch the monitor between the compiled kernel and the PyTorch formulation."""
    from attnscale.kernels import native

    os.environ[native.NATIVE_ENV] = "1" if on else "0"
    native.library.cache_clear()


def forward(model, ids, mode: str, block: int) -> None:
    from attnscale.measure.monitor import monitor

    use_compiled_kernel(mode != TORCH_STATS)
    with torch.no_grad():
        if mode in ("attnscale+monitor", TORCH_STATS, EXACT):
            with monitor(model, block=block, exact_outputs=mode == EXACT):
                model(input_ids=ids)
        elif mode == "eager+output_attentions":
            model(input_ids=ids, output_attentions=True)
        else:
            model(input_ids=ids)


def time_rounds(seq_len: int, rounds: int, block: int) -> tuple[dict, dict]:
    """(wall seconds, process CPU seconds) per forward, plain and monitored (both backends),
    interleaved over ``rounds``."""
    model, ids = build(seq_len, "attnscale")
    modes = (*MODES[:2], EXACT, TORCH_STATS)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    for mode in times:  # warm-up: thread pools, kernels
        forward(model, ids, mode, block)
    for _ in range(rounds):
        for mode in times:
            c0, t0 = time.process_time(), time.perf_counter()
            forward(model, ids, mode, block)
            times[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
    return times, cpu


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _memory_child(mode: str, seq_len: int, block: int) -> None:
    model, ids = build(seq_len, "eager" if mode.startswith("eager") else "attnscale")
    forward(model, ids[:, :64], mode, block)  # warm-up at a short length
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = _rss_kib("VmRSS")
    forward(model, ids, mode, block)
    print(json.dumps({"mib": (_rss_kib("VmHWM") - base) / 1024}))


def peak_extra_mib(mode: str, seq_len: int, block: int) -> float:
    """Peak RSS growth of one forward in ``mode``, in a fresh process (MiB)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--memory-child", mode, "--seq-len", str(seq_len),
           "--block", str(block)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])["mib"]


def main(argv: list[str] | None = None) -> int:
    from attnscale.kernels import native
    from attnscale.measure.monitor import DEFAULT_BLOCK

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="N (default 2048)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK,
                        help=f"monitor block (default {DEFAULT_BLOCK})")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--memory-child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        _memory_child(args.memory_child, args.seq_len, args.block)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"tiny Llama: hidden 256, 4 layers, 4 heads, B=1, N={args.seq_len}, float32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, block {args.block}")
    if not native.available():
        print(f"the compiled row-statistics kernel is not available ({native.NATIVE_ENV}=0 or "
              "built without a C compiler): reinstall attnscale with a C compiler")
        return 1
    print(machine.describe((1, 4, args.seq_len, 64), causal=True))
    times, cpu = time_rounds(args.seq_len, args.rounds, args.block)
    plain, plain_cpu = times["attnscale"], cpu["attnscale"]
    print(f"{machine.load()} after the rounds; ratio: median over rounds of monitored / that "
          "round's plain time; best/best: fastest of each; CPU: the same in process CPU time")
    print(f"\n{'forward':<34}{'ms':>8}{'ratio':>8}{'best/best':>10}{'CPU':>7}{'CPU b/b':>9}"
          f"{'goal':>7}")
    print(f"{'attnscale':<34}{statistics.median(plain) * 1e3:>8.0f}{1.0:>8.2f}{1.0:>10.2f}")
    for mode, label in (("attnscale+monitor", "attnscale + monitor"),
                        (EXACT, "  (exact_outputs=True)"),
                        (TORCH_STATS, "  (exact, PyTorch formulation)")):
        ratio = statistics.median(w / p for w, p in zip(times[mode], plain))
        best = min(times[mode]) / min(plain)
        cpu_ratio = statistics.median(w / p for w, p in zip(cpu[mode], plain_cpu))
        cpu_best = min(cpu[mode]) / min(plain_cpu)
        verdict = f"{GOAL:>7.2f}  {'ok' if ratio <= GOAL else 'over'}" if mode in MODES else ""
        print(f"{label:<34}{statistics.median(times[mode]) * 1e3:>8.0f}{ratio:>8.2f}{best:>10.2f}"
              f"{cpu_ratio:>7.2f}{cpu_best:>9.2f}{verdict}")

    if not args.no_memory:
        print("\npeak extra memory of one forward (peak RSS growth, MiB)")
        peaks = {mode: peak_extra_mib(mode, args.seq_len, args.block) for mode in MODES}
        eager = peaks["eager+output_attentions"]
        for mode, mib in peaks.items():
            print(f"{mode:<34}{mib:>8.1f}{mib / eager:>8.2f} × eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
