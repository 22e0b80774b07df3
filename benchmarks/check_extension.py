"""An independent evaluation of the extension study's YaRN trials: the checkpoint loaded by
transformers alone (``from_pretrained`` with the YaRN ``rope_parameters`` in its config, SDPA
attention, the whole (N, vocab) logits and ``cross_entropy`` in one call), none of attnscale's
loading, RoPE rebuilding, attention path or chunked loss, on the same window of tokens, against
the store's record of each ``hf-yarn`` treatment.

    python benchmarks/check_extension.py STORE [--factors 1.0,1.2] [--window 0]

attnscale only picks the window's tokens (``extend.window_ids``, the text selection under test
nowhere else) and reads the store; the tokens' blake2b must equal the record's, or the check
stops.  Prints one JSON line per attention factor: the loss over the whole window, over the
first L positions and beyond them, here and in the store, their differences, and the seconds
of the forward with the load average beside it (``/proc/loadavg``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path


def _stored(rows: list[dict], factor: float, a: float | None, window: int) -> dict | None:
    """The store's ``hf-yarn`` record at attention factor ``a`` (None: transformers' default)."""
    for row in rows:
        c, r = row["config"], row["result"]
        if c["window"] != window or c["factor"] != factor or not c["treatment"].startswith("hf-yarn"):
            continue
        if a is None and c["treatment"] == "hf-yarn":
            return r
        if a is not None and math.isclose(r["attention_factor"], a, rel_tol=1e-12):
            return r
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store", type=Path, help="an extension study store (docs/results/extension)")
    p.add_argument("--factors", default="default",
                   help="attention factors to check, comma-separated; 'default' is "
                        "transformers' own 0.1 ln s + 1 (default: default)")
    p.add_argument("--window", type=int, default=0)
    args = p.parse_args()
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from attnscale import sweep
    rows = list(sweep.load(args.store).ok)   # the last record of each finished trial, checked
    if not rows:
        sys.exit(f"store: {args.store} has no finished trial")
    first = rows[0]["config"]
    checkpoint, factor = Path(first["checkpoint"]), float(first["factor"])
    folder, name = (checkpoint.parent, checkpoint.name) if checkpoint.suffix == ".gguf" else \
        (checkpoint, None)
    kwargs = {"gguf_file": name} if name else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    base = AutoConfig.from_pretrained(folder, **kwargs)
    L = int(base.max_position_embeddings)
    n = round(factor * L)

    from attnscale.experiments import extend
    vocab = int(base.vocab_size)
    ids, source = extend.window_ids(tokenizer, first.get("text"), n, args.window, vocab)
    digest = hashlib.blake2b(ids.numpy().tobytes(), digest_size=8).hexdigest()

    for text in args.factors.split(","):
        a = None if text.strip() == "default" else float(text)
        record = _stored(rows, factor, a, args.window)
        if record is not None and record["tokens_blake2b"] != digest:
            sys.exit(f"window {args.window}: tokens differ from the store's "
                     f"({digest} against {record['tokens_blake2b']})")
        config = AutoConfig.from_pretrained(folder, **kwargs)
        rope = {**config.rope_parameters, "rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": L}
        if a is not None:
            rope["attention_factor"] = a
        config.rope_parameters = rope
        config.max_position_embeddings = n
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32,
                                                     attn_implementation="sdpa", **kwargs)
        model.eval()
        load = os.getloadavg()
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0].float()
            losses = F.cross_entropy(logits, ids[0, 1:], reduction="none").double()
        seconds = time.perf_counter() - start
        del logits
        ours = {"loss": float(losses.mean()), "loss_trained": float(losses[:L].mean()),
                "loss_beyond": float(losses[L:].mean())}
        scaling = {m.attention_scaling for m in model.modules() if hasattr(m, "attention_scaling")}
        out = {"window": args.window, "factor": factor, "attention_factor": max(scaling),
               "tokens_blake2b": digest, "text": source, **ours,
               "seconds": round(seconds, 1), "loadavg_before": load,
               "loadavg_after": os.getloadavg()}
        if record is None:
            out["store"] = None
        else:
            out["store"] = {k: record[k] for k in ours}
            out["difference"] = {k: ours[k] - record[k] for k in ours}
        print(json.dumps(out), flush=True)
        del model


if __name__ == "__main__":
    main()
