"""Forward + backward time of every mechanism relative to plain SDPA, measured side by side.

    python benchmarks/bench_mechanisms.py                 # B=4, H=8, N=1024, d=64, float32
    python benchmarks/bench_mechanisms.py --rounds 3      # quicker
    python benchmarks/bench_mechanisms.py --mechanisms softcap,scaled --no-memory
    python benchmarks/bench_mechanisms.py --threads 1     # less sensitive to other load
    python benchmarks/bench_mechanisms.py --device cuda --mechanisms scaled,softcap   # on a GPU
    python benchmarks/bench_mechanisms.py --mechanisms "stick-breaking,qk-rmsnorm(over=model)" --causal

Each round times plain ``scaled_dot_product_attention`` and every mechanism once each, interleaved,
so machine load hits all of them alike; a mechanism's ratio is the median over rounds of its time
divided by the same round's SDPA time.  Gradients flow to q, k, v and the mechanism's parameters.
``softcap-materialised`` (the reference path with the whole logit tensor) is an extra reference row.

Goals: <= 1.15 for every mechanism a scale on q and k (sink, logn, clip-qkv, mscale and qk-rmsnorm
over the model included), <= 1.35 for adaptive-temp (one extra blockwise entropy pass, forward and
backward), gated (the gate's projection) and the logit biases (forgetting, selective), <= 1.5 for
the blockwise kernels (softcap, sigmoid, softpick, stick-breaking) and <= 2.3 for differential
attention (two attention maps).  A mechanism may be given with options,
``qk-rmsnorm(over=model)``; ``--causal`` times causal attention (SDPA with ``is_causal``, the
``sdpa-causal`` row), where stick-breaking belongs.  The causal mechanisms (forgetting, selective)
are always timed causal, against ``sdpa-causal``.  A gating mechanism is timed with its gate:
σ(x W_g) of a (B, N, H·d) input, multiplied into the output; forgetting with its forget gates
σ(x W_f + b_f) of such an input.  On a machine shared with other work, compare with
``--threads 1`` or ``OMP_WAIT_POLICY=PASSIVE`` too: softcap's blockwise kernel runs ~20 torch ops per block, and spin-waiting OpenMP teams stall when a core is
taken (SDPA is one op).

Peak extra memory of one forward + backward is measured in a fresh subprocess per variant, as the
growth of the peak resident set size (Linux /proc/self/status) over the inputs already allocated;
it includes the gradients of q, k and v (24 MiB at the default shape).  On CUDA it is the growth
of torch's peak allocated device memory, in this process.

On CUDA, softcap runs on compiled FlexAttention (attnscale.kernels.flex): the warm-up step
compiles its forward and backward kernels, which takes a while once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import machine
from attnscale.attention import attention, attention_reference
from attnscale.experiments.lm.study import parse_variant
from attnscale.mechanisms import MECHANISMS, build_mechanism

SDPA = "sdpa"
SDPA_CAUSAL = "sdpa-causal"
MATERIALISED = "softcap-materialised"
GOAL = {"softcap": 1.5, "sigmoid": 1.5, "softpick": 1.5, "stick-breaking": 1.5,
        "adaptive-temp": 1.35, "gated": 1.35, "forgetting": 1.35, "selective": 1.35,
        "differential": 2.3, MATERIALISED: None}  # everything else: 1.15
DEFAULT_GOAL = 1.15
# Causal attention by their nature: always timed causal, against causal SDPA.
CAUSAL = ("forgetting", "selective")


def is_causal(name: str, causal: bool) -> bool:
    """Whether variant ``name`` is timed causal: with ``--causal``, or by its nature."""
    if name in (SDPA, SDPA_CAUSAL):
        return name == SDPA_CAUSAL
    return causal or (name != MATERIALISED and parse_variant(name)[0] in CAUSAL)


def baseline(name: str, causal: bool) -> str:
    """The SDPA variant ``name`` is timed against."""
    return SDPA_CAUSAL if is_causal(name, causal) else SDPA


def make_step(name: str, shape: tuple[int, int, int, int], seed: int = 0, device: str = "cpu",
              causal: bool = False):
    """A zero-argument function running one forward + backward of variant ``name``
    (``mechanism`` or ``mechanism(key=value, ...)``), causal with ``causal`` or by its nature
    (:func:`is_causal`)."""
    causal = is_causal(name, causal)
    b, h, n, d = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = (torch.randn(b, h, n, d, generator=gen).to(device) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if name in (SDPA, SDPA_CAUSAL):
        def forward():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal), ()
    elif name == MATERIALISED:
        mech = build_mechanism("softcap", d, h)

        def forward():
            return attention_reference(q, k, v, mech, causal=causal).out, ()
    elif (MECHANISMS[parse_variant(name)[0]].gate
          or MECHANISMS[parse_variant(name)[0]].logit_bias == "forget"):
        # the gate or the forget gates read the layer input: x (B, N, H·d), and W_g or W_f
        base, options = parse_variant(name)
        mech = build_mechanism(base, d, h, **options)
        proj = torch.nn.Linear(h * d, h * d, bias=False)
        mech.init_projections(proj, proj)
        mech = mech.to(device)
        x = torch.randn(b, n, h * d, generator=gen).to(device).requires_grad_()

        def forward():
            gate = mech.gate_values(x) if mech.gate else None      # (B, H, N, 1 or d)
            log_forget = mech.forget_gates(x) if mech.logit_bias == "forget" else None  # (B,H,N)
            out = attention(q, k, v, mech, gate=gate, causal=causal, log_forget=log_forget)
            return out, (x, *mech.parameters())
    else:
        base, options = parse_variant(name)
        mech = build_mechanism(base, d, h, **options).to(device)

        def forward():
            return mech(q, k, v, causal=causal), tuple(mech.parameters())

    def step():
        out, params = forward()
        torch.autograd.grad(out, (q, k, v, *params), g)
        if q.is_cuda:
            torch.cuda.synchronize()
    return step


def softcap_error(shape, device: str = "cpu") -> tuple[float, float]:
    """Max |difference| of softcap's output and of its q, k, v gradients from the materialised
    float64 reference (the kernel under timing is only worth timing if this is at rounding)."""
    b, h, n, d = shape
    gen = torch.Generator().manual_seed(1)
    q, k, v, g = (torch.randn(b, h, n, d, generator=gen).to(device) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mech = build_mechanism("softcap", d, h).to(device)
    out = mech(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_in, mech.double(), causal=True).out
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    grad_err = max((a.double() - r).abs().max().item() for a, r in zip(grads, ref_grads))
    return (out.double() - ref).abs().max().item(), grad_err


def time_rounds(names: list[str], shape, rounds: int, warmup: int = 1,
                device: str = "cpu", causal: bool = False) -> dict[str, list[float]]:
    """Seconds per forward + backward, one list per variant, measured interleaved."""
    steps = {name: make_step(name, shape, device=device, causal=causal)
             for name in [*baselines(names, causal), *names]}
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


def baselines(names: list[str], causal: bool) -> list[str]:
    """The SDPA rows the variants ``names`` are timed against, plain SDPA first."""
    return [base for base in (SDPA, SDPA_CAUSAL)
            if any(baseline(name, causal) == base for name in names)] or [SDPA]


def peak_extra_mib(name: str, shape, device: str = "cpu", causal: bool = False) -> float:
    """Peak RSS growth of one forward + backward of ``name``, in a fresh process (MiB); on CUDA
    the growth of peak allocated device memory, in this process."""
    if device != "cpu":
        step = make_step(name, shape, device=device, causal=causal)
        step()  # compiled kernels and workspaces first
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    cmd = [sys.executable, __file__, "--memory-child", name, "--shape", ",".join(map(str, shape))]
    cmd += ["--causal"] * causal
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def _status_kib(field: str) -> int:
    """A memory field of /proc/self/status (Linux), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _memory_child(name: str, shape, causal: bool = False) -> None:
    # load kernels and thread pools before the baseline
    make_step(name, (1, 1, 64, shape[-1]), causal=causal)()
    step = make_step(name, shape, causal=causal)
    before = _status_kib("VmRSS")
    try:  # reset the peak (VmHWM) to the current RSS, so import-time peaks do not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    step()
    print(f"{(_status_kib('VmHWM') - before) / 1024:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--shape", default="4,8,1024,64", help="B,H,N,d (default 4,8,1024,64)")
    parser.add_argument("--mechanisms", default=",".join(MECHANISMS),
                        help="comma-separated registry names (default: all)")
    parser.add_argument("--no-materialised", action="store_true",
                        help="skip the slow materialised-softcap reference row")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where to run (default cpu); cuda runs softcap on FlexAttention")
    parser.add_argument("--causal", action="store_true",
                        help="causal attention (SDPA's is_causal), for every variant")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.memory_child:
        _memory_child(args.memory_child, shape, args.causal)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    from attnscale.study.launcher import split_list
    names = split_list("--mechanisms", args.mechanisms)
    for name in names:  # unknown names and options fail here, before any timing
        base, options = parse_variant(name)
        build_mechanism(base, shape[-1], shape[1], **options)
    if not args.no_materialised:
        names.append(MATERIALISED)

    print(f"B,H,N,d = {shape}, float32 on {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds, forward + backward"
          + (", causal" if args.causal else ""))
    # Other processes on the same cores distort everything, most of all kernels made of many torch
    # ops: each op is an OpenMP team, and with the default spin-waiting (OMP_WAIT_POLICY unset) a
    # team whose second thread is descheduled stalls for a scheduler slice.
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(machine.describe(shape, device=args.device))
    out_err, grad_err = softcap_error(shape, args.device)
    print(f"softcap (causal) vs float64 reference: max |Δ out| {out_err:.1e}, "
          f"max |Δ grad| {grad_err:.1e}")
    times = time_rounds(names, shape, args.rounds, warmup=2 if args.device == "cuda" else 1,
                        device=args.device, causal=args.causal)
    for base in baselines(names, args.causal):
        print(f"\n{base}: median {statistics.median(times[base]) * 1e3:.0f} ms, best "
              f"{min(times[base]) * 1e3:.0f} ms")
    print("÷ SDPA: median over rounds of time / that round's SDPA time; best ÷ best: the fastest "
          "of each, the least disturbed by other load")
    print(f"{'mechanism':<22}{'ms':>8}{'÷ SDPA':>9}{'best ÷ best':>13}{'goal':>7}")
    for name in names:
        sdpa = times[baseline(name, args.causal)]
        ratio = statistics.median(t / s for t, s in zip(times[name], sdpa))
        best = min(times[name]) / min(sdpa)
        goal = GOAL.get(name.split("(")[0], DEFAULT_GOAL)
        mark = "" if goal is None else ("  ok" if ratio <= goal else "  over")
        goal_text = "-" if goal is None else f"{goal:.2f}"
        print(f"{name:<22}{statistics.median(times[name]) * 1e3:>8.0f}{ratio:>9.2f}{best:>13.2f}"
              f"{goal_text:>7}{mark}")

    if not args.no_memory:
        print("\npeak extra memory of one forward + backward (peak RSS growth, MiB)")
        for name in [*baselines(names, args.causal), *names]:
            print(f"{name:<22}{peak_extra_mib(name, shape, args.device, args.causal):>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
