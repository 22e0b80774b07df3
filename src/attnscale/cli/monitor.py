"""``attnscale monitor``: one forward pass of a local Hugging Face model under the monitor.

transformers is imported only when the command runs, so ``attnscale --help`` works without it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from attnscale.columns import RECORD_STATS
from attnscale.cli._common import add_command, add_output, format_table
from attnscale.errors import ConfigError, check_int
from attnscale.inspect.inputs import (TOKENIZER_FILES, check_model_dir, check_seed,
                                      check_seq_len, encode_prefix, read_text, vocab_size)
from attnscale.io import staged_dir
from attnscale.mechanisms import check_mechanism
from attnscale.rng import rng
from attnscale.measure.monitor import DEFAULT_BLOCK, layer_summary, monitor, plot_entropy

EXAMPLES = """
  attnscale monitor ./tiny-llama                         # random token ids if it has no tokenizer
  attnscale monitor ./my-model --text essay.txt --seq-len 512 --out runs/native
  attnscale monitor ./my-model --text essay.txt --mechanism qk-rmsnorm --out runs/qk-rmsnorm
"""

OUT_FILES = ("records.json", "entropy_heatmap.png")
TABLE_COLUMNS = ("layer", "module", "heads", "queries", *RECORD_STATS)


def _check_inputs(args) -> tuple[Path, dict, str | None]:
    """Everything that can be checked before transformers is imported (the --out folder was
    checked by :func:`attnscale.cli.main`); returns MODEL_DIR, its config.json and the text."""
    model_dir, config = check_model_dir(args.model_dir, param="MODEL_DIR")
    check_int("--seq-len", args.seq_len, minimum=1)
    check_int("--block", args.block, minimum=1)
    check_seed(args.seed, "--seed")
    text = None if args.text is None else read_text(args.text, param="--text")
    if args.mechanism is not None:
        check_mechanism(args.mechanism, param="--mechanism")
    return model_dir, config, text


def _load(model_dir: Path, mechanism: str | None):
    """The model (attn_implementation="attnscale", eval mode) and its tokenizer or None."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("attnscale monitor needs transformers: pip install 'attnscale[hf]'") \
            from None
    from safetensors import SafetensorError

    from attnscale import hf

    if mechanism is not None:
        hf.check_swappable(mechanism)  # before the (slow) load
    hf.register()
    # Our table is the output: no load reports or progress bars from transformers.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:  # with the mechanism it was saved with, if hf.set_mechanism swapped one in
        model = hf.from_pretrained(transformers.AutoModel, model_dir, param="MODEL_DIR",
                                   local_files_only=True)
    except ConfigError:
        raise
    except (ValueError, KeyError, OSError, SafetensorError) as err:
        # unknown model_type, bad, truncated or missing weights
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"cannot load MODEL_DIR {str(model_dir)!r}: {first}") from None
    hf.check_supported(model)
    if mechanism is not None:
        hf.set_mechanism(model, mechanism)
    tokenizer = None
    if any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.eval(), tokenizer


def _input_ids(args, text, model, tokenizer):
    """(1, N) token ids: the tokenised --text, or N seeded random ids (saying so on stderr)."""
    import torch

    if tokenizer is not None and text is not None:
        ids = encode_prefix(tokenizer, text, args.seq_len)  # tokenised as far as needed
        if ids.shape[1] == 0:
            raise ConfigError(f"--text {args.text!r} gives no tokens.")
        return ids, "text"
    why = "no tokenizer in MODEL_DIR" if tokenizer is None else "no --text"
    ignored = "; --text is ignored" if args.text is not None else ""
    print(f"attnscale monitor: {why}{ignored}: using {args.seq_len} random token ids "
          f"(seed {args.seed}).", file=sys.stderr)
    vocab = vocab_size(model)
    gen = rng(args.seed)  # torch.Generator().manual_seed(seed): the ids of earlier versions
    return torch.randint(0, vocab, (1, args.seq_len), generator=gen), "random"


def _finite(x):
    """NaN (a head that saw no query) as JSON null."""
    return None if isinstance(x, float) and math.isnan(x) else x


def _write_outputs(out_dir: Path, records: list[dict], meta: dict, force: bool) -> None:
    """records.json and entropy_heatmap.png, moved into ``out_dir`` only once both are written."""
    from attnscale.report.figures import new_figure, save

    with staged_dir(out_dir, force=force) as staging:
        payload = {"meta": meta,
                   "records": [{k: _finite(v) for k, v in r.items()} for r in records]}
        (staging / "records.json").write_text(json.dumps(payload, indent=1, allow_nan=False),
                                              encoding="utf-8")
        n_heads = 1 + max(r["head"] for r in records)
        n_layers = 1 + max(r["layer"] for r in records)
        fig, (ax,) = new_figure(width=max(5.0, 1.5 + 0.45 * n_heads),
                                height=max(3.6, 1.2 + 0.3 * n_layers))
        plot_entropy(records, ax, n_keys=meta["seq_len"])
        ax.set_title(f"{meta['model_type']} · {meta['mechanism']} · N={meta['seq_len']}")
        save(fig, staging / "entropy_heatmap.png")


def _run(args) -> int:
    model_dir, _, text = _check_inputs(args)
    model, tokenizer = _load(model_dir, args.mechanism)
    check_seq_len(model, args.seq_len, param="--seq-len")
    ids, source = _input_ids(args, text, model, tokenizer)

    import torch

    from attnscale import hf
    from attnscale.kernels import native

    if not native.available():
        print("attnscale monitor: the compiled statistics kernel is not installed (no C compiler "
              f"at install time, or {native.NATIVE_ENV}=0): using PyTorch operations, about "
              "2.5x slower.", file=sys.stderr)
    with torch.no_grad(), monitor(model, block=args.block) as mon:
        model(input_ids=ids)
    records = mon.records
    if not records:
        raise ConfigError(f"no attention call of {type(model).__name__} was observed; its "
                          "family does not go through transformers' attention interface.")
    swapped = getattr(model.config, hf.MECHANISM_ATTR, None)
    meta = {"model_dir": str(model_dir), "model_type": model.config.model_type,
            "mechanism": swapped["name"] if swapped else "native", "seq_len": int(ids.shape[1]),
            "input": source, "seed": args.seed,
            "statistics_kernel": native.isa() or "pytorch"}
    print(format_table(layer_summary(records), TABLE_COLUMNS))
    _write_outputs(Path(args.out), records, meta, args.force)
    print(f"Wrote {Path(args.out) / OUT_FILES[0]} and {Path(args.out) / OUT_FILES[1]}",
          file=sys.stderr)
    return 0


def register(sub) -> None:
    p = add_command(sub, "monitor", examples=EXAMPLES,
                    help="Entropy, max weight and logit scale per layer and head of a local "
                         "Hugging Face model, from one forward pass.")
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="local folder written by save_pretrained (never downloaded)")
    p.add_argument("--text", metavar="FILE", default=None,
                   help="UTF-8 text to tokenise (default: random token ids)")
    p.add_argument("--seq-len", metavar="N", type=int, default=128,
                   help="tokens in the forward pass (the text is truncated to it) "
                        "(default: %(default)s)")
    p.add_argument("--mechanism", metavar="NAME", default=None,
                   help="swap every layer's temperature for this registered mechanism, freshly "
                        "initialised (default: the model's own, or the mechanism it was saved "
                        "with after attnscale.hf.set_mechanism)")
    add_output(p, "--out", kind="dir", files=OUT_FILES, metavar="DIR", default="attnscale-monitor",
               help="output directory for records.json and entropy_heatmap.png "
                    "(default: %(default)s)")
    p.add_argument("--block", metavar="N", type=int, default=DEFAULT_BLOCK,
                   help="queries per statistics block (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random token ids (default: %(default)s)")
    p.set_defaults(func=_run)
