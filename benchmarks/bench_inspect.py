"""attnscale inspect's wall time and peak memory on real checkpoints, against the plain forward
passes it needs, and on a tiny Llama at a long context.

    python benchmarks/bench_inspect.py time --model smollm2 --lengths 1024,4096 --threads 2
    python benchmarks/bench_inspect.py profile --model smollm2 --n 1024 --threads 2
    python benchmarks/bench_inspect.py memory --model smollm2 --n 4096
    python benchmarks/bench_inspect.py memory --model gemma3 --n 4096 --dtype bfloat16
    python benchmarks/bench_inspect.py eager --model smollm2 --n 4096 --layers 2
    python benchmarks/bench_inspect.py tiny --n 8192             # 2 layers, 4 heads of 16

``time``: inspect as ``attnscale inspect`` runs it (:func:`attnscale.inspect.inspect_lengths`
with ``reinit_in_place``: the checkpoint's pass, then the init measured on the same model
re-initialised in place) against the forwards it needs, the checkpoint's and its init's, with
SDPA in the same dtype, at each length.  Interleaved rounds in one process (the weights put back
between rounds, untimed); the ratio's median over rounds and best ÷ best.

``profile``: where inspect's time goes, interleaved the same way: the SDPA forward, the forward
on attnscale's attention with nothing observed, under the monitor alone (its row statistics),
and measured as inspect measures it (the monitor and the q/k pass: coherence, q and k rms), and
the in-place re-initialisation.

``memory``: in a fresh child process each, the resident memory after the imports, after loading
the model (its weights held) and the peak while it runs (VmHWM, reset after the load where the
kernel allows it): inspect's, and a plain SDPA forward's on the same tokens.  ``eager``: HF's
eager attention with ``output_attentions=True`` (every (1, H, N, N) weight matrix returned), on
the first ``--layers`` layers, against inspect on the same truncated model.

``tiny``: the peak resident memory the report adds over a tiny Llama's own forward pass at a long
context, against one (B, H, N, N) float32 matrix.

Every figure is printed with the load average (``/proc/loadavg``): other processes share the
machine, and the ratios move with them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import checkpoints  # benchmarks/checkpoints.py

MODELS = {"smollm2": checkpoints.smollm2, "gemma3": checkpoints.gemma3,
          "minilm": checkpoints.minilm}
MIB = 2 ** 20


def load() -> str:
    """The load averages over 1, 5 and 15 minutes, as /proc/loadavg gives them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _trim() -> None:
    """Return the heap's free memory to the system (glibc's malloc_trim), so that the resident
    baseline holds what is in use: memory freed after the load would otherwise be reused
    without raising the peak, hiding up to the load's own overshoot."""
    import ctypes
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux 4.0+); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --- real checkpoints ----------------------------------------------------------------------------

def load_model(name: str, dtype: str, layers: int | None = None):
    """(model on attn_implementation="attnscale", tokenizer) of checkpoint ``name`` as
    ``attnscale inspect`` loads it; ``layers``: keep only the first ``layers`` layers."""
    from attnscale.inspect.sources import load_checkpoint

    model, tokenizer = load_checkpoint(MODELS[name](), dtype=dtype, device="cpu")
    if layers is not None:
        body = getattr(model, "layers", None)
        if body is None:
            raise SystemExit(f"--layers: {name} has no .layers to truncate")
        model.layers = body[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return model, tokenizer


def tokens(model, tokenizer, n: int) -> torch.Tensor:
    """The first ``n`` tokens of inspect's default text (text that ships with Python)."""
    from attnscale.inspect.inputs import token_ids
    return token_ids(tokenizer, None, n, vocab_size=model.config.vocab_size).ids


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())


def forward(model, ids: torch.Tensor, attn: str) -> None:
    model.set_attn_implementation(attn)
    with torch.no_grad():
        model(input_ids=ids)


def run_inspect(model, ids: torch.Tensor, block: int) -> dict:
    """inspect as the command line runs it: the checkpoint, then the init on the same model
    re-initialised in place (its trained weights are then gone)."""
    from attnscale.inspect import inspect_lengths
    model.set_attn_implementation("attnscale")
    return inspect_lengths(model, ids, [int(ids.shape[-1])], block=block, show_progress=False,
                           reinit_in_place=True)[0]


def _timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_inspect(args) -> None:
    """Interleaved rounds: SDPA forwards of the checkpoint and its init, then inspect."""
    from attnscale.inspect.inputs import reinitialise

    model, tokenizer = load_model(args.model, args.dtype)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tokens(model, tokenizer, max(args.lengths))
    print(f"{args.model}: {model.config.model_type}, {model.config.num_hidden_layers} layers, "
          f"{weight_bytes(model) / MIB:.0f} MiB of weights in {args.dtype}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; block {args.block}; "
          f"load average {load()}", flush=True)
    forward(model, ids[:, :256], "sdpa")                    # warm-up: kernels, thread pools
    run_inspect(model, ids[:, :256], args.block)
    model.load_state_dict(saved)
    for n in args.lengths:
        x = ids[:, :n]
        plain, insp = [], []
        for r in range(args.rounds):
            trained = _timed(lambda: forward(model, x, "sdpa"))
            reinitialise(model, 0)
            init = _timed(lambda: forward(model, x, "sdpa"))
            model.load_state_dict(saved)
            plain.append(trained + init)
            insp.append(_timed(lambda: run_inspect(model, x, args.block)))
            model.load_state_dict(saved)
            print(f"  N={n} round {r + 1}: SDPA checkpoint {trained:.1f} s + init {init:.1f} s "
                  f"= {plain[-1]:.1f} s; inspect {insp[-1]:.1f} s; ratio "
                  f"{insp[-1] / plain[-1]:.2f}; load {load()}", flush=True)
        ratios = [i / p for i, p in zip(insp, plain)]
        print(f"N={n}: inspect / (SDPA checkpoint + init) median {statistics.median(ratios):.2f}"
              f", best/best {min(insp) / min(plain):.2f} ({min(insp):.1f} s / {min(plain):.1f} s)"
              f" over {args.rounds} rounds, {torch.get_num_threads()} threads; load average "
              f"{load()}", flush=True)


def profile(args) -> None:
    """Where inspect's time goes, per part, in interleaved rounds at one length."""
    from attnscale.inspect.inputs import reinitialise
    from attnscale.inspect.measure import measure
    from attnscale.measure.monitor import monitor

    model, tokenizer = load_model(args.model, args.dtype)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    x = tokens(model, tokenizer, args.n)

    def plain_attnscale():
        forward(model, x, "attnscale")

    def monitor_only():
        model.set_attn_implementation("attnscale")
        with torch.no_grad(), monitor(model, block=args.block):
            model(input_ids=x)

    def measured():
        model.set_attn_implementation("attnscale")
        measure(model, {"input_ids": x}, block=args.block)

    parts = {"SDPA forward": lambda: forward(model, x, "sdpa"),
             "attnscale attention, unobserved": plain_attnscale,
             "monitor (row statistics)": monitor_only,
             "measure (monitor + q/k pass)": measured,
             "re-initialise in place": lambda: reinitialise(model, 0),
             "inspect (checkpoint + init)": lambda: run_inspect(model, x, args.block)}
    print(f"{args.model} N={args.n}, {args.dtype}, {torch.get_num_threads()} threads, block "
          f"{args.block}; load average {load()}", flush=True)
    for fn in parts.values():  # warm-up
        if fn is parts["inspect (checkpoint + init)"]:
            continue
        fn()
        model.load_state_dict(saved)
    got: dict[str, list[float]] = {k: [] for k in parts}
    for r in range(args.rounds):
        for name, fn in parts.items():
            got[name].append(_timed(fn))
            model.load_state_dict(saved)
        print(f"  round {r + 1}: " + "; ".join(f"{k} {v[-1]:.1f} s" for k, v in got.items())
              + f"; load {load()}", flush=True)
    sdpa = statistics.median(got["SDPA forward"])
    for name, times in got.items():
        print(f"{name:<34} median {statistics.median(times):7.2f} s  best {min(times):7.2f} s  "
              f"(x{statistics.median(times) / sdpa:.2f} of the SDPA forward)")
    print(f"load average {load()}")


def memory_child(args) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    import transformers  # noqa: F401  (imported before the baseline: not the model's memory)

    import attnscale.inspect  # noqa: F401
    from attnscale import hf
    hf.register()
    _trim()
    r0 = _kib("VmRSS")
    model, tokenizer = load_model(args.model, args.dtype, args.layers)
    x = tokens(model, tokenizer, args.n)
    from attnscale.inspect.measure import measure
    model.set_attn_implementation("attnscale")
    measure(model, {"input_ids": x[:, :64]}, block=args.block)       # warm-up: kernels
    _trim()
    load_peak = _kib("VmHWM")
    r1 = _kib("VmRSS")
    reset = _reset_peak()
    t0 = time.perf_counter()
    if args.child == "inspect":
        run_inspect(model, x, args.block)
    elif args.child == "sdpa":
        forward(model, x, "sdpa")
    else:  # eager, every attention matrix returned
        model.set_attn_implementation("eager")
        with torch.no_grad():
            out = model(input_ids=x, output_attentions=True)
        assert len(out.attentions) == model.config.num_hidden_layers
        del out
    seconds = time.perf_counter() - t0
    print(json.dumps({"imports_mib": r0 / 1024, "loaded_mib": r1 / 1024,
                      "load_peak_mib": load_peak / 1024, "peak_mib": _kib("VmHWM") / 1024,
                      "reset": reset, "weights_mib": weight_bytes(model) / MIB,
                      "seconds": seconds}))


def _child(args, what: str) -> dict:
    cmd = [sys.executable, __file__, args.mode, "--child", what, "--model", args.model,
           "--n", str(args.n), "--dtype", args.dtype, "--block", str(args.block)]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory(args) -> None:
    """inspect's peak memory against the weights and a plain forward (and eager attention)."""
    kinds = ("sdpa", "inspect") if args.mode == "memory" else ("inspect", "eager")
    shape = f", first {args.layers} layers" if args.layers else ""
    print(f"{args.model}{shape}, N = {args.n}, {args.dtype}, {args.threads or 'torch default'} "
          f"threads; load average {load()}", flush=True)
    for what in kinds:
        got = _child(args, what)
        held = got["loaded_mib"] - got["imports_mib"]
        extra = got["peak_mib"] - got["loaded_mib"]
        total = got["peak_mib"] - got["imports_mib"]
        print(f"{what:<8} weights {got['weights_mib']:7.0f} MiB; resident after the imports "
              f"{got['imports_mib']:6.0f} MiB, +{held:6.0f} MiB loaded (load's own peak "
              f"{got['load_peak_mib'] - got['imports_mib']:6.0f} MiB over the imports); peak "
              f"while running +{extra:7.0f} MiB over the loaded model, {total:7.0f} MiB over the "
              f"imports = {total / got['weights_mib']:.2f}x the weights"
              f"{'' if got['reset'] else ' (VmHWM not reset: the peak includes the load)'}; "
              f"{got['seconds']:.0f} s; load {load()}", flush=True)


# --- a tiny Llama at a long context ---------------------------------------------------------------

def build_tiny(n: int, layers: int, heads: int, d_head: int) -> torch.nn.Module:
    import transformers

    from attnscale import hf
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=heads * d_head,
                                      intermediate_size=2 * heads * d_head,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads, max_position_embeddings=n)
    torch.manual_seed(0)
    hf.register()
    return transformers.AutoModel.from_config(config, attn_implementation="attnscale").eval()


def tiny_child(args) -> None:
    """Print the peak RSS growth (MiB) and seconds of one ``what``: forward or inspect."""
    from attnscale.inspect import inspect_model

    model = build_tiny(args.n, args.layers, args.heads, args.d_head)
    ids = torch.randint(0, 256, (1, args.n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        inspect_model(model, ids[:, :256])       # kernels and thread pools before the baseline
        before = _kib("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        if args.child == "forward":
            model(input_ids=ids)
        else:
            inspect_model(model, ids)            # checkpoint and fresh initialisation
        seconds = time.perf_counter() - t0
    print(f"{(_kib('VmHWM') - before) / 1024:.1f} {seconds:.2f}")


def tiny(args) -> None:
    full = args.heads * args.n * args.n * 4 / MIB
    print(f"tiny Llama: {args.layers} layers, {args.heads} heads of {args.d_head}, N = {args.n}, "
          f"float32, torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{load()}; one (1, H, N, N) float32 matrix = {full:.0f} MiB")
    for what in ("forward", "inspect"):
        cmd = [sys.executable, __file__, "tiny", "--child", what, "--n", str(args.n), "--layers",
               str(args.layers), "--heads", str(args.heads), "--d-head", str(args.d_head)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
        peak, seconds = float(out[-2]), float(out[-1])
        print(f"{what:<8} peak RSS growth {peak:8.1f} MiB ({peak / full:.3f} of one (1, H, N, N)), "
              f"{seconds:.1f} s")
    print(f"load average after: {load()}")


def main(argv: list[str] | None = None) -> int:
    from attnscale.errors import parse_int_list
    from attnscale.measure.monitor import DEFAULT_BLOCK

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("time", "profile", "memory", "eager", "tiny"))
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--lengths", default="1024,4096", help="time: lengths (default 1024,4096)")
    parser.add_argument("--n", type=int, help="profile, memory, eager, tiny: the length "
                        "(default 4096; tiny: 8192)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK)
    parser.add_argument("--layers", type=int, help="memory, eager: keep only the first layers "
                        "(tiny: its layers, default 2)")
    parser.add_argument("--heads", type=int, default=4, help="tiny: heads")
    parser.add_argument("--d-head", type=int, default=16, help="tiny: head size")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.lengths = parse_int_list("--lengths", args.lengths, minimum=1)
    if args.n is None:
        args.n = 8192 if args.mode == "tiny" else 4096
    if args.mode == "tiny":
        args.layers = args.layers or 2
        tiny_child(args) if args.child else tiny(args)
    elif args.child:
        memory_child(args)
    elif args.mode in ("memory", "eager"):
        memory(args)
    elif args.mode == "time":
        time_inspect(args)
    else:
        profile(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
