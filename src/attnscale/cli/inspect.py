"""``attnscale inspect``: the temperature report of a local checkpoint (:mod:`attnscale.inspect`).

The monitor's big sibling: who owns the attention temperature, what it is now per layer × head,
and how far it drifted from the same architecture freshly initialised.  transformers is imported
only once the inputs have been checked, so ``attnscale --help`` works without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnscale.cli._common import add_command, add_output, format_table, print_json
from attnscale.errors import ConfigError, check_int

EXAMPLES = """
  attnscale inspect ./my-model                          # text that ships with Python, 256 tokens
  attnscale inspect ./my-model --text essay.txt --seq-len 512 --out runs/report
  attnscale inspect ./my-model --mechanism qk-rmsnorm   # what if qk-rmsnorm owned the temperature
  attnscale inspect ./my-model --mechanism 'yarn(factor=4)' --out runs/yarn4  # with its options
  attnscale inspect ./my-model --device cuda --dtype bfloat16 --no-init
  attnscale inspect --from runs/report                   # redraw report.md and the figures
"""

DEFAULT_OUT = "attnscale-inspect"
TABLE_COLUMNS = ("layer", "heads", "saturated", "logit_std", "entropy_ratio", "max_weight_mean",
                 "jacobian_fro_mean", "coherence", "q_rms", "k_rms")


def _check_inputs(args) -> tuple[Path | None, str | None]:
    """Everything that can be checked before a model is loaded (--out was checked by
    :func:`attnscale.cli.main`); returns MODEL_DIR and the text (None: the default)."""
    from attnscale.inspect.inputs import check_model_dir, read_text
    from attnscale.inspect.records import check_thresholds
    from attnscale.inspect.report import OUT_FILES
    from attnscale.io import check_output_path

    if args.from_dir is not None:
        if args.model_dir is not None or args.out is not None:
            raise ConfigError("--from DIR redraws the report in DIR; give it without MODEL_DIR "
                              "and --out.")
        return None, None
    if args.model_dir is None:
        raise ConfigError("give MODEL_DIR (a folder written by save_pretrained), or --from DIR "
                          "to redraw a report.")
    if args.out is None:  # the default folder, checked like a given one
        args.out = DEFAULT_OUT
        check_output_path("--out", args.out, kind="dir", files=OUT_FILES, force=args.force)
    model_dir, _ = check_model_dir(args.model_dir, param="MODEL_DIR")
    check_int("--seq-len", args.seq_len, minimum=1)
    check_int("--block", args.block, minimum=1)
    check_int("--seed", args.seed, minimum=0)
    check_thresholds(args.saturated_weight, args.saturated_entropy,
                     weight_param="--saturated-weight", entropy_param="--saturated-entropy")
    text = None if args.text is None else read_text(args.text, param="--text")
    if args.mechanism is not None:  # canonical: the spelling the report prints
        from attnscale.inspect.owner import parse_whatif, whatif_text
        args.mechanism = whatif_text(*parse_whatif(args.mechanism, param="--mechanism"))
    return model_dir, text


def _redraw(args) -> int:
    from attnscale.inspect import redraw
    redraw(args.from_dir, force=args.force, param="--from")
    print(f"Redrew {Path(args.from_dir) / 'report.md'} and its figures", file=sys.stderr)
    return 0


def _run(args) -> int:
    model_dir, text = _check_inputs(args)
    if model_dir is None:
        return _redraw(args)
    from attnscale.inspect.report import writing
    with writing(args.out, force=args.force, param="--out"):  # one writer, before any load
        return _measure(args, model_dir, text)


def _measure(args, model_dir: Path, text: str | None) -> int:
    """Load, measure and write, holding --out's writer lock."""
    from attnscale.inspect import checkpoint_meta, inspect_model, write
    from attnscale.inspect.inputs import check_seq_len, load_model, token_ids

    device = args.device  # checked by argparse (_device)
    model, tokenizer = load_model(model_dir, dtype=args.dtype, device=device, param="MODEL_DIR")
    check_seq_len(model, args.seq_len, param="--seq-len")
    tokens = token_ids(tokenizer, text, args.seq_len, vocab_size=model.config.vocab_size,
                       seed=args.seed, text_param="--text", seq_len_param="--seq-len")
    result = inspect_model(model, tokens.ids, init=not args.no_init, seed=args.seed,
                           whatif=args.mechanism, block=args.block,
                           saturated_weight=args.saturated_weight,
                           saturated_entropy=args.saturated_entropy,
                           meta=checkpoint_meta(model_dir, tokens, args.name, args.text))
    out = write(result, args.out, force=args.force, param="--out")
    if args.json:
        from attnscale.io import json_safe
        print_json(json_safe(result))
    else:
        from attnscale.inspect.report import verdict
        print("\n".join(verdict(result)))
        print()
        print(format_table(_per_layer(result["records"]), TABLE_COLUMNS))
    print(f"Wrote {out / 'report.md'}, records.json and the figures", file=sys.stderr)
    return 0


def _per_layer(records: list[dict]) -> list[dict]:
    """One row per layer: its heads, saturated heads and the median of each statistic."""
    from attnscale.inspect.records import median

    rows = []
    for layer in sorted({r["layer"] for r in records}):
        heads = [r for r in records if r["layer"] == layer]
        rows.append({"layer": layer, "heads": len(heads),
                     "saturated": sum(bool(r["saturated"]) for r in heads),
                     **{key: median(heads, key) for key in TABLE_COLUMNS[3:]}})
    return rows


def _device(text: str):
    """--device, checked as it is parsed, so that a bad one is refused before anything else."""
    import argparse

    from attnscale.inspect.inputs import resolve_device
    try:
        return resolve_device(text, param="--device")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--device: ")) from None


def register(sub) -> None:
    from attnscale.inspect.inputs import DTYPES
    from attnscale.inspect.records import SATURATED_ENTROPY_FRACTION, SATURATED_MAX_WEIGHT
    from attnscale.inspect.report import OUT_FILES
    from attnscale.measure.monitor import DEFAULT_BLOCK

    p = add_command(sub, "inspect", examples=EXAMPLES,
                    help="The temperature report of a local Hugging Face checkpoint: who owns "
                         "the attention temperature, what it is per layer and head, and how far "
                         "it drifted from a fresh initialisation.")
    p.add_argument("model_dir", metavar="MODEL_DIR", nargs="?", default=None,
                   help="local folder written by save_pretrained (never downloaded)")
    p.add_argument("--text", metavar="FILE", default=None,
                   help="UTF-8 text to read, at least --seq-len tokens (default: text that ships "
                        "with Python: the standard library's LICENSE.txt, then its source)")
    p.add_argument("--seq-len", metavar="N", type=int, default=256,
                   help="tokens in each forward pass (default: %(default)s)")
    p.add_argument("--mechanism", metavar="SPEC", default=None,
                   help="what if: also measure the checkpoint with this registered mechanism, "
                        "freshly built, in place of its temperature, side by side; NAME or "
                        "NAME(KEY=VALUE, ...) as the report spells it, e.g. "
                        "'qk-rmsnorm(over=head)' (an unknown name lists those that can run)")
    add_output(p, "--out", kind="dir", files=OUT_FILES, metavar="DIR", default=None,
               help="output directory for report.md, records.json and the figures "
                    f"(default: {DEFAULT_OUT})")
    p.add_argument("--from", dest="from_dir", metavar="DIR", default=None,
                   help="redraw report.md and the figures in DIR from its records.json, "
                        "loading no model")
    p.add_argument("--no-init", action="store_true",
                   help="skip the freshly initialised model (no drift)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the fresh initialisation and of random token ids "
                        "(default: %(default)s)")
    p.add_argument("--device", default="auto", metavar="DEVICE", type=_device,
                   help="auto, cpu, cuda or cuda:N (default: %(default)s: CUDA where available)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="dtype to run the model in (default: %(default)s, as saved); statistics "
                        "are float32 or better")
    p.add_argument("--block", metavar="N", type=int, default=DEFAULT_BLOCK,
                   help="queries per statistics block (default: %(default)s)")
    p.add_argument("--saturated-weight", metavar="X", type=float, default=SATURATED_MAX_WEIGHT,
                   help="a head is saturated above this mean max weight (default: %(default)s)")
    p.add_argument("--saturated-entropy", metavar="X", type=float,
                   default=SATURATED_ENTROPY_FRACTION,
                   help="... or below this fraction of ln n in entropy (default: %(default)s)")
    p.add_argument("--name", default=None, help="the report's title (default: MODEL_DIR's name)")
    p.add_argument("--json", action="store_true",
                   help="print the records (records.json's contents) as one JSON object")
    p.set_defaults(func=_run)
