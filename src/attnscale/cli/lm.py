"""``attnscale lm``: train one small byte-level language model with a temperature mechanism
(Wortsman et al.'s recipe) and print its run record; the JSON conventions of ``attnscale train``."""

from __future__ import annotations

import json

from attnscale.cli._common import add_command, add_output, format_table, parse_options, \
    print_json
from attnscale.errors import ConfigError
from attnscale.io import atomic_write

EXAMPLES = """
  attnscale lm                                      # scaled, width 64, 500 steps on the stdlib
  attnscale lm --mechanism qk-layernorm --lr 3e-2 --width 128 --heads 4
  attnscale lm --mechanism softcap --option cap=30 --steps 1000 --json > run.json
  attnscale lm --data ~/notes/ --seq-len 256 --output run.json   # any text file or folder
  attnscale lm --device cuda --bf16 --width 256 --heads 8 --threads 1
"""

_COLUMNS = ["mechanism", "width", "lr", "seed", "loss_init", "final_val_loss", "final_val_bpb",
            "diverged", "attn_logit_max", "tokens_per_second"]


def _row(record: dict) -> dict:
    from attnscale.experiments.lm.study import peak_logit
    c = record["config"]
    return {"mechanism": c["mechanism"], "width": c["d_model"], "lr": c["lr"], "seed": c["seed"],
            "loss_init": record["loss_init"], "final_val_loss": record["final_val_loss"],
            "final_val_bpb": record["final_val_bpb"], "diverged": record["diverged"],
            "attn_logit_max": peak_logit(record),
            "tokens_per_second": record["timing"]["tokens_per_second"]}


def _run(args) -> int:
    from attnscale.experiments.lm.train import LMRunConfig, train_lm
    if args.data is not None and args.data == "":
        raise ConfigError("--data must be a path to a text file or folder, got ''.")
    config = LMRunConfig(
        mechanism=args.mechanism, options=parse_options(args.option, args.mechanism),
        lr=args.lr, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
        seq_len=args.seq_len, max_seq_len=args.max_seq_len, batch_size=args.batch_size,
        steps=args.steps, seed=args.seed, eval_windows=args.eval_windows,
        monitor_every=args.monitor_every, data=args.data, device=args.device, bf16=args.bf16,
        threads=args.threads).validated()
    record = train_lm(config)
    if args.output is not None:  # checked before training (cli._common.check_outputs)
        atomic_write(args.output, json.dumps({"runs": [record]}, allow_nan=False),
                     param="--output", force=args.force)
    if args.json:
        print_json({"runs": [record]})
    else:
        print(format_table([_row(record)], _COLUMNS))
    return 0


def register(sub) -> None:
    from attnscale.experiments.lm.train import LMRunConfig
    d = LMRunConfig()
    p = add_command(sub, "lm", examples=EXAMPLES,
                    help="Train one small byte-level LM (Wortsman et al.'s recipe) and report "
                         "its validation loss, divergence and attention statistics.")
    p.add_argument("--mechanism", default=d.mechanism,
                   help="attention-temperature mechanism (default: %(default)s)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the mechanism, e.g. cap=30 (repeatable)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    for flag, dest, text in (
            ("--width", "d_model", "d_model"), ("--layers", "n_layers", "transformer blocks"),
            ("--heads", "n_heads", "attention heads; must divide --width"),
            ("--seq-len", "seq_len", "context in bytes"),
            ("--batch-size", "batch_size", "sequences per step"),
            ("--steps", "steps", "optimiser steps"), ("--seed", "seed", "init and data seed"),
            ("--eval-windows", "eval_windows", "validation windows"),
            ("--monitor-every", "monitor_every", "attention statistics every k steps")):
        p.add_argument(flag, dest=dest, type=int, default=getattr(d, dest),
                       help=f"{text} (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context the model is built for (default: --seq-len)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text file or folder (default: the running Python's stdlib .py files)")
    p.add_argument("--device", default=d.device, help="torch device (default: %(default)s)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the forward pass")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="CPU intra-op threads (default: %(default)s)")
    p.add_argument("--json", action="store_true", help='print one JSON object {"runs": [...]}')
    add_output(p, "--output", metavar="FILE", help='also write {"runs": [...]} to FILE')
    p.set_defaults(func=_run)
