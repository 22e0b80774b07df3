"""A small random gpt-oss forward on attn_implementation="attnscale" against HF's "eager".

    python benchmarks/bench_gpt_oss.py                    # N = 2048, 2 layers, 8 heads of 64
    python benchmarks/bench_gpt_oss.py --n 512 --rounds 2 # quicker
    python benchmarks/bench_gpt_oss.py --threads 1

transformers runs gpt-oss on "eager" (its modeling code sets ``_supports_sdpa = False``: the sinks
need the logits), which materialises the (B, H, N, N + 1) logits; "attnscale" keeps the learned
sinks as the pipeline's sink normaliser on SDPA (one extra key).  Prints the median time ratio
over interleaved rounds (and best ÷ best), the peak extra memory of one forward of each (peak RSS
growth, in a fresh process), and the largest tensor any op creates during the attnscale forward,
against B · H · N · N: the check that no (B, H, N, N) tensor is formed.  Goal: <= 0.5 × eager.
The outputs are compared first (max |Δ logit|).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import machine
from attnscale import hf

GOAL = 0.5
IMPLEMENTATIONS = ("eager", "attnscale")


def build(n: int, layers: int, heads: int, attn: str) -> transformers.PreTrainedModel:
    """gpt-oss with a full and a sliding-window layer, random weights and sinks (seed 0); its
    experts kept small (2 of width 64, top-1), so that the time is mostly attention."""
    hf.register()
    config = transformers.GptOssConfig(
        vocab_size=1024, hidden_size=heads * 64, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
        num_local_experts=2, num_experts_per_tok=1, sliding_window=128,
        max_position_embeddings=max(n, 4096),
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) +
                    ["full_attention"] * (layers % 2),
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    model.set_attn_implementation(attn)
    return model


def ids(n: int) -> torch.Tensor:
    return torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(1))


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _memory_child(attn: str, n: int, layers: int, heads: int) -> None:
    model = build(n, layers, heads, attn)
    x = ids(n)
    with torch.no_grad():
        model(x[:, :64])  # kernels and thread pools before the baseline
        before = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        model(x)
    print(f"{(_status_kib('VmHWM') - before) / 1024:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    parser.add_argument("--heads", type=int, default=8, help="query heads of 64 (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        _memory_child(args.memory_child, args.n, args.layers, args.heads)
        return 0
    models = {attn: build(args.n, args.layers, args.heads, attn) for attn in IMPLEMENTATIONS}
    x = ids(args.n)
    print(f"gpt-oss, {args.layers} layers, {args.heads} heads of 64, N = {args.n}, float32, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print(machine.describe((1, args.heads, args.n, 64), causal=True))
    with torch.no_grad():
        outs = {attn: model(x).logits for attn, model in models.items()}  # also the warm-up
        print(f"max |Δ logit| attnscale vs eager: "
              f"{(outs['attnscale'] - outs['eager']).abs().max().item():.1e}")
        mode = LargestTensor()
        with mode:
            models["attnscale"](x)
        full = args.heads * args.n * args.n
        print(f"largest tensor in the attnscale forward: {mode.largest:,} elements; "
              f"B·H·N·N = {full:,} ({'none formed' if mode.largest < full else 'FORMED'})")
        times = {attn: [] for attn in IMPLEMENTATIONS}
        for _ in range(args.rounds):
            for attn, model in models.items():
                t0 = time.perf_counter()
                model(x)
                times[attn].append(time.perf_counter() - t0)
    ratio = statistics.median(a / e for a, e in zip(times["attnscale"], times["eager"]))
    best = min(times["attnscale"]) / min(times["eager"])
    for attn in IMPLEMENTATIONS:
        print(f"{attn:<10} median {statistics.median(times[attn]) * 1e3:8.0f} ms")
    print(f"attnscale ÷ eager: median {ratio:.2f}, best ÷ best {best:.2f}, goal <= {GOAL} "
          f"({'ok' if ratio <= GOAL else 'over'})")
    if not args.no_memory:
        print("peak extra memory of one forward (peak RSS growth, MiB)")
        for attn in IMPLEMENTATIONS:
            cmd = [sys.executable, __file__, "--memory-child", attn, "--n", str(args.n),
                   "--layers", str(args.layers), "--heads", str(args.heads)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            print(f"{attn:<10}{float(done.stdout.strip()):>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
