"""Cost of ``attnscale.guard`` in a training loop, and of QK-Clip's S_max tracking.

    python benchmarks/bench_guard.py                     # 1 and 2 threads, 5 rounds each
    python benchmarks/bench_guard.py --threads 2 --rounds 3 --seq-len 256

Training steps: a tiny random HF Llama (hidden 256, 4 layers, 4 query / 2 key-value heads,
``attn_implementation="sdpa"``), batch 1 at N = ``--seq-len`` (512), Adam.  A round runs ``every``
(10) training steps of each variant back to back, interleaved so machine load hits all alike:

* ``plain``: no guard;
* ``guard``: ``attnscale.guard(model, every=10)``, records on one step in ten (goal <= 1.05x);
* ``guard+clip``: with ``qk_clip`` (K2 mode), so S_max is tracked on every step (goal <= 1.10x;
  ms-swift's MuonClip costs about 15%);
* ``guard (every step)``: ``every=1``, every step a recorded one: the price of the statistics
  (goal <= 1.2x, as the monitor's);
* ``guard+strict``: the strict clip, one extra forward per step (no goal; its price).

The ratio is the median over rounds of variant ÷ plain of the same round, and best ÷ best (the
fastest of each, the least disturbed by other load); the CPU columns are the same two of process
CPU time (on 1 thread the work itself, whatever else shares the cores).

S_max tracking: one multi-head attention call (B, H, N, d = 4, 8, 1024, 64, not causal), forward +
backward on SDPA, with and without the tracking that the ``qk-clip`` mechanism and the guard add
(:func:`attnscale.kernels.peak.head_peaks`: one blocked q kᵀ for the maximum alone, through the
bfloat16 screen on a CPU with AMX); goal <= 1.15x SDPA.  The figures are only meaningful on an idle
machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.nn.functional as F

import machine

EVERY_STEP = "guard (every step)"
GOALS = {"guard": 1.05, "guard+clip": 1.10, EVERY_STEP: 1.2, "guard+strict": None}
TRACK_GOAL = 1.15


def build_llama(seq_len: int, seed: int = 0):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=seq_len,
                                   attention_dropout=0.0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    return model, ids


def make_runner(variant: str, seq_len: int, every: int):
    """A zero-argument function running ``every`` training steps of ``variant``."""
    import attnscale

    model, ids = build_llama(seq_len)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    options = {"guard": {}, "guard+clip": {"qk_clip": 100.0}, EVERY_STEP: {"every": 1},
               "guard+strict": {"qk_clip": 100.0, "strict": True}}.get(variant)
    g = None
    if options is not None:
        g = attnscale.guard(model, optimizer=opt, **{"every": every, **options},
                            alarm_logit=None, alarm_entropy_fraction=None)
    state = {"step": 0}

    def run() -> None:
        # Entered for the variant's own steps only: the plain steps run with no SDPA tap.
        with g if g is not None else contextlib.nullcontext():
            steps()

    def steps() -> None:
        for _ in range(every):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if g is not None:
                g.step(state["step"])
            state["step"] += 1
    return run


def time_interleaved(runners: dict, rounds: int) -> tuple[dict, dict]:
    """(wall seconds, process CPU seconds) per round of each runner, interleaved."""
    for run in runners.values():  # warm-up
        run()
    times = {name: [] for name in runners}
    cpu = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            c0, t0 = time.process_time(), time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return times, cpu


def report(measured: tuple[dict, dict], base: str, goals: dict) -> None:
    times, cpu = measured
    ref, ref_cpu = times[base], cpu[base]
    print(f"  {'variant':<20}{'ms':>9}{'÷ ' + base:>10}{'best ÷ best':>13}{'CPU ÷':>8}"
          f"{'CPU b÷b':>9}{'goal':>7}")
    print(f"  {base:<20}{statistics.median(ref) * 1e3:>9.1f}")
    for name, t in times.items():
        if name == base:
            continue
        ratio = statistics.median(a / b for a, b in zip(t, ref))
        best = min(t) / min(ref)
        cpu_ratio = statistics.median(a / b for a, b in zip(cpu[name], ref_cpu))
        cpu_best = min(cpu[name]) / min(ref_cpu)
        goal = goals.get(name)
        mark = "" if goal is None else ("  ok" if ratio <= goal else "  over")
        goal_text = "-" if goal is None else f"{goal:.2f}"
        print(f"  {name:<20}{statistics.median(t) * 1e3:>9.1f}{ratio:>10.2f}{best:>13.2f}"
              f"{cpu_ratio:>8.2f}{cpu_best:>9.2f}{goal_text:>7}{mark}")
    print(f"  {machine.load()}")


def tracking_runners(shape=(4, 8, 1024, 64)) -> dict:
    """SDPA forward + backward alone, with the qk-clip mechanism (tracking in its forward), and
    with the guard's tracking (head_peaks on the same q and k)."""
    from attnscale.kernels.peak import head_peaks
    from attnscale.mechanisms import build_mechanism

    b, h, n, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(b, h, n, d, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    clip = build_mechanism("qk-clip", d, h).train()
    scale = d ** -0.5

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), g)

    def mechanism():
        out = clip(q, k, v)
        torch.autograd.grad(out, (q, k, v), g)
        clip.reset()

    def guard_tracking():
        head_peaks(q, k, scale)
        sdpa()

    return {"sdpa": sdpa, "qk-clip": mechanism, "guard tracking": guard_tracking}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--seq-len", type=int, default=512, help="N of the training steps")
    parser.add_argument("--every", type=int, default=10, help="the guard's every (default 10)")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2],
                        help="torch thread counts to run (default 1 2)")
    parser.add_argument("--no-tracking", action="store_true", help="skip the S_max section")
    parser.add_argument("--variants", default=",".join(GOALS),
                        help=f"comma-separated guard variants (default {','.join(GOALS)})")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs, {args.rounds} rounds")
    print(machine.describe((1, 4, args.seq_len, 64), causal=True))
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s): {args.every} training steps of a tiny Llama, N = "
              f"{args.seq_len}")
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in variants if v not in GOALS]
        if unknown:
            parser.error(f"--variants: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(GOALS)}")
        runners = {name: make_runner(name, args.seq_len, args.every)
                   for name in ("plain", *variants)}
        report(time_interleaved(runners, args.rounds), "plain", GOALS)
        if not args.no_tracking:
            print(f"{threads} thread(s): S_max tracking, B,H,N,d = 4,8,1024,64, forward + "
                  "backward")
            report(time_interleaved(tracking_runners(), args.rounds), "sdpa",
                   {"qk-clip": TRACK_GOAL, "guard tracking": TRACK_GOAL})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
