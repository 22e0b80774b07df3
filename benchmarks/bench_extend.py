"""Wall time and peak memory of one long forward of the extension study
(:mod:`attnscale.experiments.extend`): a checkpoint read as the study reads it, one window of N
tokens of Python's own text, the next-token loss at every position through attnscale's causal
path (no (B, H, N, N) tensor) and the chunked LM head.

    python benchmarks/bench_extend.py CHECKPOINT [--length 16384] [--treatment hf-yarn]
        [--rounds 1]

Prints one JSON line per round (treatments interleaved when several are given): seconds, the
peak resident memory over the forward (Linux VmHWM, reset before it), the resident memory
before it, the torch threads and the load average before and after (``/proc/loadavg``: other
work on the machine slows a forward, so read every figure with it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--length", type=int, default=16384, help="tokens per forward (default 16384)")
    p.add_argument("--treatment", action="append", default=None,
                   help="a treatment of the extension study (repeatable; default hf-yarn)")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    from attnscale.experiments import extend
    treatments = args.treatment or [extend.HF_YARN]
    model, tokenizer = extend._load(args.checkpoint, "auto")
    L = extend.trained_length(model)
    factor = args.length / L
    vocab = int(model.get_output_embeddings().weight.shape[0])
    ids, source = extend.window_ids(tokenizer, None, args.length, 0, vocab)
    times: dict[str, list[float]] = {t: [] for t in treatments}
    for r in range(args.rounds):
        for text in treatments:  # interleaved rounds
            model, _ = extend._load(args.checkpoint, "auto")
            how = extend.parse_treatment(text)
            setting = extend.applied(model, how, factor, L) if factor > 1 else {}
            load = os.getloadavg()
            with extend.PeakRSS() as peak:
                start = time.perf_counter()
                losses = extend.position_losses(model, ids)
                seconds = time.perf_counter() - start
            times[text].append(seconds)
            import torch
            print(json.dumps({"round": r, "treatment": how.text, "length": args.length,
                              "train_len": L, "seconds": round(seconds, 2),
                              "peak_rss_gib": None if peak.peak is None else
                              round(peak.peak / 2**30, 3),
                              "rss_before_gib": None if peak.before is None else
                              round(peak.before / 2**30, 3), "peak_exact": peak.exact,
                              "loss": round(float(losses.mean()), 4),
                              "attention_factor": setting.get("attention_factor"),
                              "threads": torch.get_num_threads(), "text": source,
                              "loadavg_before": load, "loadavg_after": os.getloadavg()}),
                  flush=True)
    if args.rounds > 1:
        for text, ts in times.items():
            print(json.dumps({"treatment": text, "median_seconds": statistics.median(ts),
                              "best_seconds": min(ts)}))


if __name__ == "__main__":
    main()
