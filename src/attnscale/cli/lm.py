"""``attnscale lm``: train one small byte-level language model with a temperature mechanism
(Wortsman et al.'s recipe) and print its run record; the JSON conventions of ``attnscale train``."""

from __future__ import annotations

import os
from pathlib import Path

from attnscale.cli._common import add_command, format_table, print_json
from attnscale.cli.train import _parse_option
from attnscale.errors import ConfigError

EXAMPLES = """
  attnscale lm                                      # scaled, width 64, 300 steps on the stdlib
  attnscale lm --mechanism qk-layernorm --lr 3e-2 --width 128 --heads 4
  attnscale lm --mechanism softcap --option cap=30 --steps 1000 --json > run.json
  attnscale lm --data ~/notes/ --seq-len 256 --output run.json   # any text file or folder
  attnscale lm --device cuda --bf16 --width 256 --heads 8 --threads 1
"""

_COLUMNS = ["mechanism", "width", "lr", "seed", "loss_init", "final_val_loss", "final_val_bpb",
            "diverged", "attn_logit_max", "tokens_per_second"]


def check_output_file(param: str, path: str) -> Path:
    """A path a file can be written to (its folder exists and is writable, it is not a folder);
    checked before any training."""
    if path == "":
        raise ConfigError(f"{param} must be a file path, got ''.")
    out = Path(path)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ConfigError(f"{param} {path!r} is a directory; give a file path.")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"{param} {path!r}: folder {str(parent)!r} does not exist or is not "
                          "writable.")
    return out


def _option(text: str) -> tuple[str, object]:
    """``key=value`` as ``attnscale train`` reads it, plus true/false as booleans."""
    key, value = _parse_option(text)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, value


def _row(record: dict) -> dict:
    c = record["config"]
    peaks = [m for row in record["trace"] for m in row["attn_logit_max"] if m is not None]
    return {"mechanism": c["mechanism"], "width": c["d_model"], "lr": c["lr"], "seed": c["seed"],
            "loss_init": record["loss_init"], "final_val_loss": record["final_val_loss"],
            "final_val_bpb": record["final_val_bpb"], "diverged": record["diverged"],
            "attn_logit_max": max(peaks, default=None),
            "tokens_per_second": record["tokens_per_second"]}


def _run(args) -> int:
    from attnscale.experiments.lm.train import RunConfig, train_lm
    from attnscale.experiments.recall.outputs import write_json_atomic
    output = check_output_file("--output", args.output) if args.output is not None else None
    if args.data is not None and args.data == "":
        raise ConfigError("--data must be a path to a text file or folder, got ''.")
    config = RunConfig(
        mechanism=args.mechanism, options=dict(_option(o) for o in args.option),
        lr=args.lr, d_model=args.width, n_layers=args.layers, n_heads=args.heads,
        seq_len=args.seq_len, max_seq_len=args.max_seq_len, batch_size=args.batch_size,
        steps=args.steps, seed=args.seed, eval_windows=args.eval_windows,
        monitor_every=args.monitor_every, data=args.data, device=args.device, bf16=args.bf16,
        threads=args.threads).validated()
    record = train_lm(config)
    if output is not None:
        write_json_atomic(output, {"runs": [record]})
    if args.json:
        print_json({"runs": [record]})
    else:
        print(format_table([_row(record)], _COLUMNS))
    return 0


def register(sub) -> None:
    from attnscale.experiments.lm.train import RunConfig
    d = RunConfig()
    p = add_command(sub, "lm", examples=EXAMPLES,
                    help="Train one small byte-level LM (Wortsman et al.'s recipe) and report "
                         "its validation loss, divergence and attention statistics.")
    p.add_argument("--mechanism", default=d.mechanism,
                   help="attention-temperature mechanism (default: %(default)s)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the mechanism, e.g. cap=30 (repeatable)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--width", type=int, default=d.d_model, help="d_model (default: %(default)s)")
    p.add_argument("--layers", type=int, default=d.n_layers, help="blocks (default: %(default)s)")
    p.add_argument("--heads", type=int, default=d.n_heads,
                   help="attention heads; must divide --width (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help="context in bytes (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context the model is built for (default: --seq-len)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="sequences per step (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimiser steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="init and data seed (default: %(default)s)")
    p.add_argument("--eval-windows", type=int, default=d.eval_windows,
                   help="validation windows (default: %(default)s)")
    p.add_argument("--monitor-every", type=int, default=d.monitor_every,
                   help="attention statistics every k steps (default: %(default)s)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text file or folder (default: the running Python's stdlib .py files)")
    p.add_argument("--device", default=d.device, help="torch device (default: %(default)s)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the forward pass")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="CPU intra-op threads (default: %(default)s)")
    p.add_argument("--json", action="store_true", help='print one JSON object {"runs": [...]}')
    p.add_argument("--output", metavar="FILE", help='also write {"runs": [...]} to FILE')
    p.set_defaults(func=_run)
