"""``attnscale inspect``: the temperature report of local checkpoints (:mod:`attnscale.inspect`).

The monitor's big sibling: who owns the attention temperature, what it is now per layer × head,
and how far it drifted from the same architecture freshly initialised; for several models side
by side, a training run's checkpoints in step order, and several lengths
(:mod:`attnscale.inspect.multi`).  transformers is imported only once the inputs have been
checked, so ``attnscale --help`` works without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnscale.cli._common import add_command, add_output, format_table, print_json
from attnscale.errors import ConfigError, check_int

EXAMPLES = """
  attnscale inspect ./my-model                          # text that ships with Python, 256 tokens
  attnscale inspect SmolLM2-135M-Instruct.Q4_1.gguf      # a llama.cpp / Ollama file (dequantised)
  attnscale inspect runs/my-trainer-run                  # its checkpoint-N folders: trajectories
  attnscale inspect ./minilm model.gguf ./gemma --out runs/compare    # models side by side
  attnscale inspect model.gguf --lengths 256,1024,4096  # entropy and peak logit against ln n
  attnscale inspect ./my-model --text essay.txt --seq-len 512 --out runs/report
  attnscale inspect ./my-model --mechanism qk-rmsnorm   # what if qk-rmsnorm owned the temperature
  attnscale inspect ./my-model --mechanism 'yarn(factor=4)' --out runs/yarn4  # with its options
  attnscale inspect ./my-model --device cuda --dtype bfloat16 --no-init
  attnscale inspect --from runs/report                   # redraw report.md and the figures
"""

DEFAULT_OUT = "attnscale-inspect"
DEFAULT_SEQ_LEN = 256
TABLE_COLUMNS = ("layer", "heads", "saturated", "logit_std", "entropy_ratio", "max_weight_mean",
                 "jacobian_fro_mean", "coherence", "q_rms", "k_rms")


def _check_inputs(args) -> tuple[list | None, str | None]:
    """Everything that can be checked before a model is loaded (--out was checked by
    :func:`attnscale.cli.main`); returns the sources (:func:`attnscale.inspect.sources.resolve`)
    and the text (None: the default), or (None, None) for --from."""
    from attnscale.errors import parse_int_list
    from attnscale.inspect.inputs import check_seed, read_text
    from attnscale.inspect.records import check_judged_length, check_thresholds
    from attnscale.inspect.sources import resolve

    if args.from_dir is not None:
        if args.paths or args.out is not None:
            raise ConfigError("--from DIR redraws the report in DIR; give it without PATH "
                              "and --out.")
        return None, None
    if not args.paths:
        raise ConfigError("give PATH (a folder written by save_pretrained, a .gguf file or a "
                          "run folder of checkpoint-N), or --from DIR to redraw a report.")
    if args.lengths is not None:
        if args.seq_len is not None:
            raise ConfigError("give --seq-len N or --lengths N,N,..., not both.")
        args.lengths = parse_int_list("--lengths", args.lengths, minimum=1)
    else:
        args.lengths = [check_int("--seq-len", DEFAULT_SEQ_LEN if args.seq_len is None
                                  else args.seq_len, minimum=1)]
    args.lengths = sorted(args.lengths)
    if args.out is None:
        args.out = DEFAULT_OUT
    sources = resolve(args.paths, param="PATH")
    check_int("--block", args.block, minimum=1)
    check_seed(args.seed, param="--seed")
    check_thresholds(args.saturated_weight, args.saturated_entropy,
                     weight_param="--saturated-weight", entropy_param="--saturated-entropy")
    for n in args.lengths:  # a length where every head is saturated by construction
        check_judged_length(n, args.saturated_weight,
                            param="--seq-len" if args.seq_len is not None else "--lengths")
    text = None if args.text is None else read_text(args.text, param="--text")
    if args.mechanism is not None:  # canonical: the spelling the report prints
        from attnscale.inspect.owner import parse_whatif, whatif_text
        args.mechanism = whatif_text(*parse_whatif(args.mechanism, param="--mechanism"))
    return sources, text


def _redraw(args) -> int:
    from attnscale.inspect import redraw
    from attnscale.inspect.multi import INDEX, draw_pages, load_index
    from attnscale.inspect.report import writing

    folder = Path(args.from_dir)
    if not (folder / INDEX).is_file():
        redraw(folder, force=args.force, param="--from")
        print(f"Redrew {folder / 'report.md'} and its figures", file=sys.stderr)
        return 0
    with writing(folder, force=args.force, param="--from"):
        entries = load_index(folder, "--from")["entries"]
        for entry in entries:
            redraw(folder / entry.folder, force=args.force, param="--from")
        pages = draw_pages(folder, force=args.force, param="--from")
    print(f"Redrew {len(entries)} reports and {len(pages)} pages in {folder}", file=sys.stderr)
    return 0


def _run(args) -> int:
    sources, text = _check_inputs(args)
    if sources is None:
        return _redraw(args)
    from attnscale.inspect.multi import check_outputs, plan
    from attnscale.inspect.report import writing

    check_outputs(Path(args.out), plan(sources, args.lengths), force=args.force, param="--out")
    with writing(args.out, force=args.force, param="--out"):  # one writer, before any load
        return _measure(args, sources, text)


def _device_map(device) -> str | None:
    """``"auto"`` on CUDA where accelerate is installed (layers placed over the GPUs and, past
    their memory, the CPU), else None (the whole model on ``device``)."""
    import importlib.util
    if device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
        return "auto"
    return None


def _measure(args, sources: list, text: str | None) -> int:
    """Load, measure and write, holding --out's writer lock."""
    from attnscale.inspect.multi import inspect_paths, is_single, plan

    payloads = inspect_paths(
        sources, args.out, lengths=args.lengths, text=text, text_file=args.text,
        init=not args.no_init, seed=args.seed, whatif=args.mechanism, block=args.block,
        dtype=args.dtype, device=args.device, device_map=_device_map(args.device),
        saturated_weight=args.saturated_weight, saturated_entropy=args.saturated_entropy,
        name=args.name, force=args.force, param="--out",
        params={"text": "--text", "path": "PATH",
                "seq_len": "--lengths" if len(args.lengths) > 1 else "--seq-len"})
    out = Path(args.out)
    if args.json:
        from attnscale.io import json_safe
        print_json(json_safe(payloads[0] if len(payloads) == 1 else payloads))
    elif is_single(plan(sources, args.lengths)):
        from attnscale.inspect.report import verdict
        print("\n".join(verdict(payloads[0])))
        print()
        print(format_table(_per_layer(payloads[0]["records"]), TABLE_COLUMNS))
    else:
        from attnscale.inspect.report import verdict
        for payload in payloads:
            meta = payload["meta"]
            print(f"{meta['name']} · N={meta['seq_len']}: {verdict(payload)[0]}")
    if len(payloads) == 1:
        print(f"Wrote {out / 'report.md'}, records.json and the figures", file=sys.stderr)
    else:
        print(f"Wrote {len(payloads)} reports and their pages under {out}", file=sys.stderr)
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
    p.add_argument("paths", metavar="PATH", nargs="*", default=[],
                   help="a local folder written by save_pretrained, a .gguf file (llama.cpp, "
                        "Ollama; needs attnscale[gguf]) or a training run's folder of "
                        "checkpoint-N folders; several PATHs are compared side by side "
                        "(never downloaded)")
    p.add_argument("--text", metavar="FILE", default=None,
                   help="UTF-8 text to read, at least --seq-len tokens (default: text that ships "
                        "with Python: the standard library's LICENSE.txt, then its source)")
    p.add_argument("--seq-len", metavar="N", type=int, default=None,
                   help=f"tokens in each forward pass (default: {DEFAULT_SEQ_LEN})")
    p.add_argument("--lengths", metavar="N,N,...", default=None,
                   help="measure at each of these lengths, on the same text prefix, and fit "
                        "each head's entropy and peak logit against ln n (lengths.md)")
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
    p.add_argument("--name", default=None,
                   help="the report's title, for one model (default: PATH's name)")
    p.add_argument("--json", action="store_true",
                   help="print the records (records.json's contents) as one JSON object")
    p.set_defaults(func=_run)
