"""Training throughput of ``attnscale.lm`` against a plain PyTorch LM, and the monitor's cost.

    python benchmarks/bench_lm.py                         # width 128, 2 layers, B=16, N=128
    python benchmarks/bench_lm.py --threads 1,2 --rounds 7 --width 256 --heads 4
    python benchmarks/bench_lm.py --device cuda --bf16 --width 512 --heads 8 --batch-size 64

Throughput: the reference is the same architecture written out directly (pre-norm, RoPE, no
biases, 4x GELU MLP, tied embeddings) calling ``F.scaled_dot_product_attention(is_causal=True)``;
it loads attnscale's weights, and its logits are checked against attnscale's before timing.  Each
round times ``--steps`` training steps (forward, backward, clipping, AdamW) of each model,
alternating which goes first, so machine load hits both alike.  Reported per thread count: the
median over rounds of attnscale ÷ reference tokens/s, and best ÷ best.  Goal: >= 0.9.

Quick study (``--quick-study``): the wall time of ``attnscale study lm --quick --workers 2`` in a
fresh folder, in a subprocess.  Goal: <= 10 minutes on a 2-core machine.

Monitor: the same rounds time attnscale's model with ``attnscale.monitor(model, every=k)`` around
the loop (k = ``LMRunConfig.monitor_every``, the default of ``attnscale lm``); the cost is the median
of (monitored − plain) ÷ plain.  Goal: <= 10%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import machine
from attnscale.experiments.lm.model import (MLP_RATIO, NORM_EPS, VOCAB_SIZE, LMConfig,
                                            apply_rope, build_lm)
from attnscale.experiments.lm.train import (ADAM_BETAS, ADAM_EPS, GRAD_CLIP, LMRunConfig,
                                            lm_loss)
from attnscale.measure.monitor import monitor

THROUGHPUT_GOAL = 0.9
QUICK_GOAL_SECONDS = 600
MONITOR_GOAL = 0.10


class RefAttention(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.n_heads, -1).transpose(1, 2)
                   for w in (self.w_q, self.w_k, self.w_v))
        o = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v,
                                           is_causal=True)
        return self.w_o(o.transpose(1, 2).reshape(b, n, d))


class RefBlock(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.ln_attn = nn.LayerNorm(d, eps=NORM_EPS, bias=False)
        self.attn = RefAttention(d, n_heads)
        self.ln_mlp = nn.LayerNorm(d, eps=NORM_EPS, bias=False)
        self.mlp = nn.Module()
        self.mlp.up = nn.Linear(d, MLP_RATIO * d, bias=False)
        self.mlp.down = nn.Linear(MLP_RATIO * d, d, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln_attn(x), cos, sin)
        return x + self.mlp.down(F.gelu(self.mlp.up(self.ln_mlp(x))))


class RefLM(nn.Module):
    """The reference: the same model with SDPA called directly (parameter names match)."""

    def __init__(self, c: LMConfig, cos, sin):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, c.d_model)
        self.blocks = nn.ModuleList(RefBlock(c.d_model, c.n_heads) for _ in range(c.n_layers))
        self.ln_out = nn.LayerNorm(c.d_model, eps=NORM_EPS, bias=False)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens):
        n = tokens.shape[-1]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.rope_cos[:n], self.rope_sin[:n])
        return F.linear(self.ln_out(x), self.embed.weight)


def train_seconds(model, batches, args, every: int | None = None) -> float:
    """Wall time of len(batches) training steps (the monitor around them when ``every``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=ADAM_BETAS, eps=ADAM_EPS,
                            weight_decay=0.1, foreach=True)
    ctx = monitor(model, every=every) if every else None
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16,
                              enabled=args.bf16)
    sync()
    start = time.perf_counter()
    if ctx is not None:
        ctx.__enter__()
    try:
        for t, (x, y) in enumerate(batches):
            if ctx is not None:
                ctx.step = t
            with autocast:
                logits = model(x)
            _, loss = lm_loss(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            if ctx is not None and t % every == 0:
                ctx.records  # what train_lm reads at an observed step
                ctx.reset()
        sync()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return time.perf_counter() - start


def measure(args, threads: int) -> dict:
    torch.set_num_threads(threads)
    c = LMConfig(d_model=args.width, n_layers=args.layers, n_heads=args.heads,
                 max_seq_len=args.seq_len, mechanism="scaled")
    ours = build_lm(c, seed=0, device=args.device)
    ref = RefLM(c, ours.rope_cos.clone(), ours.rope_sin.clone()).to(args.device)
    ref.load_state_dict(ours.state_dict(), strict=True)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(args.device) for t in
                     torch.randint(0, VOCAB_SIZE, (2, args.batch_size, args.seq_len),
                                   generator=gen)) for _ in range(args.steps)]
    with torch.no_grad():
        assert_close(ours(batches[0][0]), ref(batches[0][0]), rtol=1e-4, atol=1e-4)
    every = LMRunConfig().monitor_every
    tokens = args.steps * args.batch_size * args.seq_len
    train_seconds(ours, batches[:3], args)  # warm-up
    train_seconds(ref, batches[:3], args)
    t_ours, t_ref, t_mon = [], [], []
    for r in range(args.rounds):
        order = [("ref", ref), ("ours", ours)] if r % 2 else [("ours", ours), ("ref", ref)]
        for name, model in order:
            (t_ours if name == "ours" else t_ref).append(train_seconds(model, batches, args))
        t_mon.append(train_seconds(ours, batches, args, every=every))
    ratios = [b / a for a, b in zip(t_ours, t_ref)]  # tokens/s ours ÷ ref = t_ref ÷ t_ours
    costs = [(m - o) / o for m, o in zip(t_mon, t_ours)]
    return {"threads": threads, "tokens_per_s_attnscale": tokens / statistics.median(t_ours),
            "tokens_per_s_reference": tokens / statistics.median(t_ref),
            "ratio_median": statistics.median(ratios), "ratio_best_best": min(t_ref) / min(t_ours),
            "throughput_goal": THROUGHPUT_GOAL, "monitor_every": every,
            "monitor_cost_median": statistics.median(costs), "monitor_goal": MONITOR_GOAL}


def quick_study(workers: int) -> dict:
    """Wall time of ``attnscale study lm --quick`` in a temporary folder."""
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys; from attnscale.cli import main; "
                        "sys.exit(main(sys.argv[1:]))", "study", "lm", "--quick", "--out",
                        f"{tmp}/quick", "--workers", str(workers), "--json"],
                       check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
    return {"quick_study_seconds": wall, "workers": workers, "goal_seconds": QUICK_GOAL_SECONDS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="training steps per timing")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--quick-study", action="store_true",
                   help="also time 'attnscale study lm --quick --workers 2'")
    args = p.parse_args()
    threads = [int(t) for t in args.threads.split(",")] if args.device == "cpu" else [1]
    print(machine.describe((args.batch_size, args.heads, args.seq_len, args.width // args.heads),
                           torch.bfloat16 if args.bf16 else torch.float32, args.device,
                           causal=True))
    for n in threads:
        row = measure(args, n)
        print(json.dumps(row))
        print(f"threads {n}: attnscale/reference tokens/s {row['ratio_median']:.3f} median, "
              f"{row['ratio_best_best']:.3f} best/best (goal >= {THROUGHPUT_GOAL}); monitor every "
              f"{row['monitor_every']} steps costs {100 * row['monitor_cost_median']:.1f}% "
              f"(goal <= {100 * MONITOR_GOAL:.0f}%)", flush=True)
    if args.quick_study:
        row = quick_study(2)
        print(json.dumps(row))
        print(f"study lm --quick on 2 workers: {row['quick_study_seconds']:.0f} s "
              f"(goal <= {QUICK_GOAL_SECONDS} s)")


if __name__ == "__main__":
    main()
