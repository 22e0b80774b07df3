"""attnscale inspect's memory and time on a tiny Llama at a long context: the peak resident memory
the report adds over the model's own forward pass, against one (B, H, N, N) float32 matrix.

    python benchmarks/bench_inspect.py                 # N = 8192, 2 layers, 4 heads of 16
    python benchmarks/bench_inspect.py --n 4096 --threads 1

Each measurement runs in a fresh child process (peak RSS, VmHWM, reset after warm-up where the
kernel allows it), so one does not inherit another's high-water mark.  Prints the load average.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import transformers

from attnscale import hf


def build(n: int, layers: int, heads: int, d_head: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=heads * d_head,
                                      intermediate_size=2 * heads * d_head,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads, max_position_embeddings=n)
    torch.manual_seed(0)
    hf.register()
    return transformers.AutoModel.from_config(config, attn_implementation="attnscale").eval()


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def child(what: str, n: int, layers: int, heads: int, d_head: int) -> None:
    """Print the peak RSS growth (MiB) and seconds of one ``what``: forward or inspect."""
    from attnscale.inspect import inspect_model

    model = build(n, layers, heads, d_head)
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        inspect_model(model, ids[:, :256])       # kernels and thread pools before the baseline
        before = _kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                     # reset VmHWM to the current RSS
        except OSError:
            pass
        t0 = time.perf_counter()
        if what == "forward":
            model(input_ids=ids)
        else:
            inspect_model(model, ids)            # checkpoint and fresh initialisation
        seconds = time.perf_counter() - t0
    print(f"{(_kib('VmHWM') - before) / 1024:.1f} {seconds:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8192, help="sequence length (default 8192)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-head", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = (args.n, args.layers, args.heads, args.d_head)
    if args.child:
        child(args.child, *shape)
        return 0
    full = args.heads * args.n * args.n * 4 / 2 ** 20
    print(f"tiny Llama: {args.layers} layers, {args.heads} heads of {args.d_head}, N = {args.n}, "
          f"float32, torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.2f}; one (1, H, N, N) float32 matrix = {full:.0f} MiB")
    for what in ("forward", "inspect"):
        cmd = [sys.executable, __file__, "--child", what, "--n", str(args.n), "--layers",
               str(args.layers), "--heads", str(args.heads), "--d-head", str(args.d_head)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
        peak, seconds = float(out[-2]), float(out[-1])
        print(f"{what:<8} peak RSS growth {peak:8.1f} MiB ({peak / full:.3f} of one (1, H, N, N)), "
              f"{seconds:.1f} s")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
