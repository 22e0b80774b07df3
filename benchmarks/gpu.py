"""One prepared GPU run: every check that needs a GPU, in one command of at most 8 minutes.

    pip install --no-deps --no-build-isolation -e .     # on the GPU machine, once (or
    python benchmarks/gpu.py --out gpu-run.json          #   PYTHONPATH=src): full sizes, ~4 min
    python benchmarks/gpu.py --device cpu --out x.json   # the same run at small sizes (the tests)

It prints one table, a line per check as the check finishes, and writes the same rows as JSON
(``{"meta": ..., "rows": [...]}``) to ``--out``, replaced atomically after every row, so a run
that is killed leaves every row it finished.  Each row is computed on its own: one that raises
(one mechanism failing on CUDA, an out-of-memory, a missing ``transformers``) becomes a row with
``check: "error"`` and its error, and the run goes on.  Rows still to come when ``--budget``
seconds have passed are written as ``check: "skipped"``.

The sections, each driven by the registry (a mechanism added on another branch is picked up by
what it declares, not by a list here):

``values``
    Every registry mechanism in :class:`attnscale.MultiHeadAttention` (causal), on the device in
    bfloat16 and in float32, against a float64 twin on the CPU with the same weights: the output
    and the gradients of the input and of every parameter, each as max |Δ| ÷ max |reference|
    (a gradient's reference at least a tenth of the module's largest).
``flex``
    The mechanisms whose logits carry more than a scale of q kᵀ under the plain softmax, as they
    declare it: a soft-cap (``cap``) or a logit bias of their own (``logit_bias``, forgetting and
    selective attention).  FlexAttention's ``score_mod`` expresses a cap and FoX's bias (run with
    log forget gates of its own here), and :mod:`attnscale.kernels.flex` runs them on CUDA;
    selective attention's F is a prefix sum over the queries, so it runs on its blockwise kernel
    (:mod:`attnscale.kernels.biased`) there.  Through :func:`attnscale.attention`, forward +
    backward: the fused path against the materialised one (``trace=True``), same outputs and
    gradients, and the time of each ÷ SDPA (FlashAttention where PyTorch picks it, the row says
    which), interleaved rounds.  Whether a FlexAttention kernel ran is read from the profiler.
``lm``
    The LM (:mod:`attnscale.experiments.lm`) at width 512 for 50 steps in bfloat16 autocast,
    AdamW, random bytes: steps per second plain, with the guard (``every=10``, alarms off) and
    with the guard and QK-Clip (τ = 100, Kimi K2's), interleaved, each ÷ plain.
``monitor``
    ``attnscale.monitor`` on the tiny Llama of ``benchmarks/bench_monitor.py`` (hidden 256, 4
    layers, 4 heads of 64) at N = 8192 on ``attn_implementation="attnscale"``: a monitored
    forward ÷ a plain one, interleaved, and the peak extra GPU memory of each.

Sizes and the 8-minute budget, estimated from FLOP counts at H200 rates (about 790 TFLOP/s bf16
matrix work, 4.3 TB/s memory, both measured there; float32 without TF32 about 50 TFLOP/s):

* ``flex`` at B4 H16 N4096 d64, causal: attention forward 4·B·H·N²·d / 2 = 137 GFLOP,
  forward + backward about 3.5x = 0.48 TFLOP, a few ms for SDPA and the fused path; the
  materialised path moves about 10 float32 (B, H, N, N) tensors of 4.3 GB (40 GB, about 10 ms)
  and multiplies in float32 (0.8 TFLOP, about 16 ms): some 30 ms a call and 40 GB at its peak.
  5 rounds x 10 calls x 3 paths x 2 dtypes per mechanism: about 5 s.  Compiling FlexAttention
  forward + backward takes tens of seconds per mechanism and shape (two shapes: this one and the
  ``values`` one): budget 40 s each.
* ``values`` at B2 N256 width 256, 4 heads: 0.3 GFLOP per case, negligible; the float64 CPU twin
  takes milliseconds; about 0.3 s per case of launch overhead, 27 mechanisms x 2 dtypes: 20 s.
* ``lm``: 6.4M parameters, 16 x 128 tokens a step: 6 · 6.4M · 2048 = 79 GFLOP a step (0.1 ms of
  matrix work); eager steps are launch-bound, some 10-20 ms with the guard: 3 variants x
  (3 warm-up + 2 rounds x 50) steps, about 6 s.
* ``monitor`` at N = 8192: per forward, SDPA 4 layers x 4·4·N²·64 = 69 GFLOP, and the monitor
  scores 4 x 4 x N² = 1.1 G logits again (137 GFLOP and a few passes over 4 GB): tens of ms;
  5 rounds: about 1 s.

With start-up (CUDA, imports: about 20 s) and two FlexAttention mechanisms (softcap, forgetting)
compiled at two shapes, about 4 minutes; ``--budget`` (default 420 s) stops starting new rows
in time for the 8-minute limit whatever the compiler does.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import machine
from attnscale import __version__
from attnscale.io import atomic_write, check_output_path, json_safe

# Relative error bounds (max |Δ| ÷ max |reference|) of the checks, by dtype: bfloat16 keeps 8 bits
# of mantissa (2^-8 = 4e-3 per rounding, sums of many), float32 24 bits.
VALUES_TOL = {torch.bfloat16: {"out": 5e-2, "grad": 1e-1},
              torch.float32: {"out": 1e-4, "grad": 1e-4}}
FLEX_TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}
DTYPES = (torch.bfloat16, torch.float32)
# Kimi K2's QK-Clip threshold (arXiv 2507.20534).
QK_CLIP_TAU = 100.0
GUARD_EVERY = 10
SECTIONS = ("values", "flex", "lm", "monitor")


@dataclass(frozen=True)
class Sizes:
    """What each section runs at (see the module doc for the budget)."""
    values: tuple[int, int, int, int]      # B, N, d_model, heads of the MultiHeadAttention check
    flex: tuple[int, int, int, int]        # B, H, N, d of the FlexAttention timing
    flex_rounds: int                       # interleaved rounds
    flex_reps: int                         # calls per path per round
    lm: tuple[int, int, int, int, int]     # width, heads, layers, batch, sequence length
    lm_steps: int                          # timed steps per variant per round
    lm_rounds: int
    monitor_n: int                         # tokens of the tiny Llama
    monitor_rounds: int


FULL = Sizes(values=(2, 256, 256, 4), flex=(4, 16, 4096, 64), flex_rounds=5, flex_reps=10,
             lm=(512, 8, 2, 16, 128), lm_steps=50, lm_rounds=2, monitor_n=8192, monitor_rounds=5)
# The CPU run of the tests: every section end to end in seconds.
SMALL = Sizes(values=(2, 8, 16, 2), flex=(1, 2, 32, 16), flex_rounds=2, flex_reps=1,
              lm=(32, 2, 1, 2, 16), lm_steps=2, lm_rounds=1, monitor_n=64, monitor_rounds=1)


# ---------------------------------------------------------------------------------------------
# Rows: printed as one table, line by line, and kept on disk as JSON after every row


class Run:
    """The rows of one run, the table they print as, and the JSON file they are written to."""

    COLUMNS = (("section", 8), ("case", 16), ("dtype", 9), ("check", 8), ("result", 0))

    def __init__(self, out: str | None, meta: dict, budget: float, force: bool = False):
        self.out, self.meta, self.rows, self.force = out, meta, [], force
        self.deadline = time.monotonic() + budget
        self.meta["rows_done"] = 0
        self.write()
        print(" ".join(f"{name:<{width}}" for name, width in self.COLUMNS).rstrip(), flush=True)

    def row(self, section: str, case: str, dtype: torch.dtype | None,
            compute: Callable[[], dict]) -> dict:
        """Run ``compute`` (a dict of results with ``check`` and ``result``) into one row; an
        exception becomes an error row, and past the deadline nothing runs."""
        row = {"section": section, "case": case,
               "dtype": "-" if dtype is None else str(dtype).removeprefix("torch.")}
        start = time.perf_counter()
        if time.monotonic() > self.deadline:
            row.update(check="skipped", result="past the time budget (--budget)")
        else:
            try:
                row.update(compute())
            except Exception as err:  # noqa: BLE001 - a failing check is a row, not a crash
                row.update(check="error", result=f"{type(err).__name__}: {err}".splitlines()[0],
                           traceback=traceback.format_exc(limit=-4))
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        row["seconds"] = time.perf_counter() - start
        self.rows.append(row)
        self.meta["rows_done"] = len(self.rows)
        self.write()
        print(" ".join(f"{row[name]:<{width}}" for name, width in self.COLUMNS).rstrip(),
              flush=True)
        return row

    def write(self) -> None:
        """Replace ``--out`` with the meta and every row so far (atomically)."""
        if self.out is None:
            return
        text = json.dumps(json_safe({"meta": self.meta, "rows": self.rows}), indent=1)
        atomic_write(self.out, text + "\n", param="--out", force=self.force)
        self.force = False  # the file is ours now (the manifest records it)


# ---------------------------------------------------------------------------------------------
# Helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def maxabs(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def rel_err(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """max |got − want| ÷ max(max |want|, ``floor``), in float64 on the CPU; NaN when either
    holds a NaN or an infinity."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())):
        return math.nan
    err = maxabs(got - want)
    scale = max(maxabs(want), floor)
    return err / scale if scale > 0 else err


def interleaved(calls: dict[str, Callable[[], None]], rounds: int, reps: int,
                device: torch.device) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls`` over ``rounds`` interleaved rounds of ``reps`` calls
    (the order reversed every other round); one warm-up call each first (compiles, caches)."""
    for call in calls.values():
        call()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in (list(calls) if r % 2 == 0 else list(reversed(calls))):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                calls[name]()
            sync(device)
            times[name].append((time.perf_counter() - t0) / reps)
    return times


def ratio(times: dict[str, list[float]], name: str, base: str) -> tuple[float, float]:
    """(median over rounds of ``name`` ÷ ``base``, best ÷ best)."""
    med = statistics.median(a / b for a, b in zip(times[name], times[base]))
    return med, min(times[name]) / min(times[base])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# values: every mechanism against a float64 CPU twin


def values_section(run: Run, device: torch.device, sizes: Sizes) -> None:
    from attnscale.mechanisms import MECHANISMS

    for name in MECHANISMS:
        for dtype in DTYPES:
            run.row("values", name, dtype, lambda: check_values(name, dtype, device, sizes))


def check_values(name: str, dtype: torch.dtype, device: torch.device, sizes: Sizes) -> dict:
    """Output and gradients of ``name`` in MultiHeadAttention on ``device`` in ``dtype`` against
    the same module in float64 on the CPU."""
    from attnscale.attention import MultiHeadAttention

    b, n, width, heads = sizes.values
    torch.manual_seed(0)
    mha = MultiHeadAttention(width, heads, name).train(False)  # no power-iteration step
    twin = copy.deepcopy(mha).double()
    mha = mha.to(device=device, dtype=dtype)
    x64 = torch.randn(b, n, width, generator=gen(1), dtype=torch.float64)
    g64 = torch.randn(b, n, width, generator=gen(2), dtype=torch.float64)
    x = x64.to(device=device, dtype=dtype).requires_grad_()
    out = mha(x, causal=True)
    (out.float() * g64.to(device=device, dtype=torch.float32)).sum().backward()
    x_ref = x64.clone().requires_grad_()
    want = twin(x_ref, causal=True)
    (want * g64).sum().backward()
    pairs = {"x": (x.grad, x_ref.grad)}
    for (p_name, p), (_, p_ref) in zip(mha.named_parameters(), twin.named_parameters()):
        if (p.grad is None) != (p_ref.grad is None):
            raise RuntimeError(f"gradient of {p_name} is missing on one side")
        if p.grad is not None:
            pairs[p_name] = (p.grad, p_ref.grad)
    # A gradient that is 0 in exact arithmetic (a LayerNorm bias on k, which the softmax's shift
    # invariance cancels) has only rounding left: each is judged against a tenth of the largest
    # gradient of the module at least.
    floor = 0.1 * max(maxabs(want_g) for _, want_g in pairs.values())
    grads = {k: rel_err(got_g, want_g, floor) for k, (got_g, want_g) in pairs.items()}
    errors = {"out": rel_err(out, want)}
    worst = max(grads, key=lambda key: math.inf if math.isnan(grads[key]) else grads[key])
    tol = VALUES_TOL[dtype]
    ok = errors["out"] <= tol["out"] and all(v <= tol["grad"] for v in grads.values())
    return {"check": "ok" if ok else "over", "out_err": errors["out"], "grad_err": grads[worst],
            "grad_worst": worst, "grad_errs": grads, "tol": tol,
            "result": f"out {errors['out']:.1e}, grad {grads[worst]:.1e} ({worst}); tolerance "
                      f"{tol['out']:.0e} / {tol['grad']:.0e}"}


# ---------------------------------------------------------------------------------------------
# flex: FlexAttention against the materialised path, and against SDPA


def flex_mechanisms() -> list[str]:
    """Registry mechanisms whose logits carry more than a scale of q kᵀ under the plain
    softmax, by what they declare: a soft-cap (``cap``, set per instance by its option) or a
    logit bias of their own (``logit_bias``).  FlexAttention's ``score_mod`` expresses such a
    change of each logit; :mod:`attnscale.kernels.flex` runs it on CUDA."""
    from attnscale.mechanisms import MECHANISMS, build_mechanism

    names = []
    for name in MECHANISMS:
        mech = build_mechanism(name, 64, 2)
        if mech.normaliser == "softmax" and (mech.cap is not None
                                             or getattr(mech, "logit_bias", None)):
            names.append(name)
    return names


def flex_section(run: Run, device: torch.device, sizes: Sizes) -> None:
    names = run.row("flex", "mechanisms", None, lambda: {
        "check": "ok", "mechanisms": flex_mechanisms(),
        "result": "declaring a cap or a logit bias: " + ", ".join(flex_mechanisms())})
    for name in names.get("mechanisms", []):
        for dtype in DTYPES:
            run.row("flex", name, dtype, lambda: check_flex(name, dtype, device, sizes))


def check_flex(name: str, dtype: torch.dtype, device: torch.device, sizes: Sizes) -> dict:
    """Forward + backward of ``name`` through attention(): the fused path against the
    materialised one (outputs and gradients), and the time of each ÷ SDPA."""
    from attnscale.attention import attention
    from attnscale.mechanisms import build_mechanism

    b, h, n, d = sizes.flex
    mech = build_mechanism(name, d, h).to(
        device=device, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
    q, k, v, g = (torch.randn(b, h, n, d, generator=gen(seed)).to(device=device, dtype=dtype)
                  for seed in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    log_forget = None
    if getattr(mech, "logit_bias", None) == "forget":  # FoX's bias needs gates, f ≈ 0.95
        log_forget = F.logsigmoid(torch.randn(b, h, n, generator=gen(4)) + 3.0).to(device)

    def step(forward: Callable[[], torch.Tensor]) -> Callable[[], tuple]:
        def call() -> tuple:
            out = forward()
            return (out.detach(), *torch.autograd.grad(out, (q, k, v), g))
        return call

    calls = {
        "fused": step(lambda: attention(q, k, v, mech, causal=True, log_forget=log_forget)),
        "materialised": step(lambda: attention(q, k, v, mech, causal=True, trace=True,
                                               log_forget=log_forget).out),
        "sdpa": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    got, want = calls["fused"](), calls["materialised"]()
    out_err = rel_err(got[0], want[0])
    grad_err = max(rel_err(a, b_) for a, b_ in zip(got[1:], want[1:]))
    del got, want
    path, kernels = fused_path(calls["fused"], device)
    times = interleaved(calls, sizes.flex_rounds, sizes.flex_reps, device)
    fused, fused_best = ratio(times, "fused", "sdpa")
    mat, mat_best = ratio(times, "materialised", "sdpa")
    kernel = machine.sdpa_kernel((b, h, n, d), dtype, device, causal=True)
    tol = FLEX_TOL[dtype]
    ok = out_err <= tol and grad_err <= tol
    return {"check": "ok" if ok else "over", "out_err": out_err, "grad_err": grad_err, "tol": tol,
            "ms": {k: 1e3 * statistics.median(t) for k, t in times.items()},
            "fused_over_sdpa": fused, "fused_over_sdpa_best": fused_best,
            "materialised_over_sdpa": mat, "materialised_over_sdpa_best": mat_best,
            "sdpa_kernel": kernel, "path": path, "top_kernels": kernels,
            "result": f"Δout {out_err:.1e} Δgrad {grad_err:.1e}; fused {fused:.2f}x {kernel} "
                      f"(best {fused_best:.2f}x), materialised {mat:.2f}x; {path}"}


def fused_path(call: Callable[[], tuple], device: torch.device) -> tuple[str, list[str]]:
    """Which kernels one fused call ran, from the profiler: "FlexAttention" when an op or kernel
    of that name ran (eagerly: ``FlexAttentionAutogradOp``), or a Triton template kernel
    (``triton_tem_*``, which inductor generates FlexAttention from under the default compile
    mode), and the three that took longest."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        call()
        sync(device)
    events = prof.key_averages()

    def spent(e) -> float:
        for attr in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
            value = getattr(e, attr, None)
            if value:
                return float(value)
        return 0.0

    top = [e.key for e in sorted(events, key=spent, reverse=True)[:3]]
    flex_ran = any("flex" in e.key.lower() or e.key.startswith("triton_tem") for e in events)
    if flex_ran:
        return "FlexAttention", top
    return ("no FlexAttention kernel" if device.type == "cuda" else "CPU kernels"), top


# ---------------------------------------------------------------------------------------------
# lm: training steps per second, plain, with the guard, with the guard and QK-Clip


def lm_section(run: Run, device: torch.device, sizes: Sizes) -> None:
    times: dict[str, list[float]] = {}
    rows = run.row("lm", "setup", torch.bfloat16,
                   lambda: time_lm(device, sizes, times))
    if rows["check"] == "error":
        return
    for variant in ("plain", "guard", "guard+qk-clip"):
        run.row("lm", variant, torch.bfloat16, lambda: lm_row(variant, times, sizes))


def time_lm(device: torch.device, sizes: Sizes, times: dict[str, list[float]]) -> dict:
    """Train the three variants side by side; fill ``times`` (seconds per timed stretch)."""
    from attnscale.experiments.lm.model import VOCAB_SIZE, LMConfig, build_lm
    from attnscale.experiments.lm.train import ADAM_BETAS, ADAM_EPS, lm_loss
    from attnscale.guard import guard

    width, heads, layers, batch, seq = sizes.lm
    config = LMConfig(d_model=width, n_layers=layers, n_heads=heads, max_seq_len=seq)
    batches = [torch.randint(0, VOCAB_SIZE, (2, batch, seq), generator=gen(s)).to(device)
               for s in range(8)]
    options = {"plain": None, "guard": {}, "guard+qk-clip": {"qk_clip": QK_CLIP_TAU}}
    losses: list[float] = []

    def runner(variant: str) -> Callable[[int], None]:
        model = build_lm(config, seed=0, device=device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=ADAM_BETAS, eps=ADAM_EPS)
        g = None if options[variant] is None else guard(
            model, optimizer=opt, every=GUARD_EVERY, alarm_logit=None,
            alarm_entropy_fraction=None, **options[variant])
        state = {"step": 0}

        def steps(count: int) -> None:
            with g if g is not None else contextlib.nullcontext():
                for _ in range(count):
                    x, y = batches[state["step"] % len(batches)]
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        logits = model(x)                                   # (B, N, 256)
                    _, loss = lm_loss(logits, y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    if g is not None:
                        g.step(state["step"])
                    state["step"] += 1
                losses.append(float(loss.detach()))
        return steps

    runners = {variant: runner(variant) for variant in options}
    for steps in runners.values():
        steps(3)                                                            # warm-up
    sync(device)
    for r in range(sizes.lm_rounds):
        for variant in (list(runners) if r % 2 == 0 else list(reversed(runners))):
            sync(device)
            t0 = time.perf_counter()
            runners[variant](sizes.lm_steps)
            sync(device)
            times.setdefault(variant, []).append(time.perf_counter() - t0)
    finite = all(math.isfinite(v) for v in losses)
    return {"check": "ok" if finite else "nan", "width": width, "heads": heads,
            "layers": layers, "batch": batch, "seq_len": seq,
            "result": f"width {width}, {heads} heads, {layers} layers, batch {batch} x {seq}, "
                      f"{sizes.lm_steps} steps x {sizes.lm_rounds} rounds, bf16 autocast; "
                      f"losses {'finite' if finite else 'NOT finite'}"}


def lm_row(variant: str, times: dict[str, list[float]], sizes: Sizes) -> dict:
    per_s = [sizes.lm_steps / t for t in times[variant]]
    over, best = ratio(times, variant, "plain")
    return {"check": "ok", "steps_per_s": statistics.median(per_s),
            "steps_per_s_best": max(per_s), "over_plain": over, "over_plain_best": best,
            "result": f"{statistics.median(per_s):.1f} steps/s (best {max(per_s):.1f}); time "
                      f"÷ plain {over:.2f} (best ÷ best {best:.2f})"}


# ---------------------------------------------------------------------------------------------
# monitor: a monitored forward of a tiny Llama against a plain one


def monitor_section(run: Run, device: torch.device, sizes: Sizes) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    run.row("monitor", f"llama N={sizes.monitor_n}", dtype,
            lambda: check_monitor(device, dtype, sizes))


def check_monitor(device: torch.device, dtype: torch.dtype, sizes: Sizes) -> dict:
    from bench_monitor import build

    from attnscale.measure.monitor import monitor

    model, ids = build(sizes.monitor_n, "attnscale")
    model, ids = model.to(device=device, dtype=dtype), ids.to(device)
    seen: list[list[dict]] = []

    def plain() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    def monitored() -> None:
        with torch.no_grad(), monitor(model) as mon:
            model(input_ids=ids)
        seen.append(mon.records)

    times = interleaved({"plain": plain, "monitored": monitored}, sizes.monitor_rounds, 1,
                        device)
    over, best = ratio(times, "monitored", "plain")
    memory = {k: peak_extra_mib(fn, device) for k, fn in (("plain", plain),
                                                          ("monitored", monitored))}
    records = seen[-1]
    cfg = model.config
    expected = cfg.num_hidden_layers * cfg.num_attention_heads
    sane = len(records) == expected and all(
        0.0 <= r["entropy_mean"] <= math.log(sizes.monitor_n) + 1e-6 for r in records)
    mem = ("" if memory["plain"] is None else
           f"; peak extra {memory['plain']:.0f} MiB plain, {memory['monitored']:.0f} monitored")
    return {"check": "ok" if sane else "records", "records": len(records),
            "ms": {k: 1e3 * statistics.median(t) for k, t in times.items()},
            "over_plain": over, "over_plain_best": best, "peak_extra_mib": memory,
            "result": f"monitored ÷ plain {over:.2f} (best ÷ best {best:.2f}), "
                      f"{1e3 * statistics.median(times['plain']):.1f} ms plain{mem}"}


def peak_extra_mib(call: Callable[[], None], device: torch.device) -> float | None:
    """Peak GPU memory one call allocates beyond what was allocated before it (MiB); None on the
    CPU."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    call()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


# ---------------------------------------------------------------------------------------------


def describe(device: torch.device, sizes: Sizes) -> dict:
    """The run's setting: versions, device, instruction set, SDPA kernels, load, sizes."""
    meta = {"attnscale": __version__, "torch": torch.__version__, "device": str(device),
            "sizes": asdict(sizes), "argv": sys.argv[1:], "started": time.strftime("%FT%T%z"),
            "load_average": list(os.getloadavg()), "cpus": os.cpu_count(),
            "instruction_set": machine.instruction_set(),
            "sdpa_kernel": {str(dt).removeprefix("torch."): machine.sdpa_kernel(
                sizes.flex, dt, device, causal=True) for dt in DTYPES}}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30,
                    cuda=torch.version.cuda,
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--out", default="gpu-run.json", help="the JSON file (gpu-run.json)")
    parser.add_argument("--force", action="store_true", help="replace an --out attnscale did "
                        "not write")
    parser.add_argument("--sizes", choices=("full", "small"),
                        help="full (the default on CUDA) or small (the default on the CPU)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which no new row starts (default 420)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device (use --device cpu)")
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or len(set(sections)) != len(sections):
        parser.error(f"--sections: give each of {', '.join(SECTIONS)} at most once, got "
                     f"{args.sections!r}")
    out = str(check_output_path("--out", args.out, suffixes=(".json",), force=args.force))
    sizes = {"full": FULL, "small": SMALL}[args.sizes or ("full" if device.type == "cuda"
                                                         else "small")]
    meta = describe(device, sizes)
    print(f"attnscale {__version__}, torch {torch.__version__}, {meta.get('gpu', device)}; "
          f"{machine.load()}")
    print(machine.describe(sizes.flex, torch.bfloat16, device, causal=True))
    run = Run(out, meta, args.budget, force=args.force)
    runners = {"values": values_section, "flex": flex_section, "lm": lm_section,
               "monitor": monitor_section}
    for section in sections:
        runners[section](run, device, sizes)
    counts = {c: sum(r["check"] == c for r in run.rows) for c in
              sorted({r["check"] for r in run.rows})}
    run.meta.update(finished=time.strftime("%FT%T%z"), checks=counts,
                    load_average_end=list(os.getloadavg()))
    run.write()
    print(f"{len(run.rows)} rows: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f"; {machine.load()}; written to {out}")
    return 0 if set(counts) <= {"ok"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
