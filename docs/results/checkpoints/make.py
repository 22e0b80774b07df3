"""Regenerate docs/results/checkpoints: ``attnscale inspect`` on three real checkpoints and one
training run, every page written by attnscale itself (this script only runs it).

    python docs/results/checkpoints/make.py               # everything not yet measured
    python docs/results/checkpoints/make.py --only run    # one part: minilm, smollm2, gemma3,
                                                          # compare, run
    python docs/results/checkpoints/make.py --redraw      # every page from its stores, no model

The parts, each one ``attnscale inspect`` call whose folder is named below:

* ``all-MiniLM-L6-v2/``: the BERT encoder (its ``save_pretrained`` folder) at 64, 128, 256 and
  512 tokens (its 512 positions): a report per length and ``lengths.md``;
* ``SmolLM2-135M-Instruct.Q4_1/`` and ``gemma-3-270m-q4_k_m/``: the two decoders from their GGUF
  files (dequantised to float32), SmolLM2 at 256, 1024 and 4096 tokens, Gemma 3 at 128, 256, 512,
  1024 and 4096 (its sliding-window layers' keys stop growing at 512);
* ``compare/``: the three side by side at 256 tokens, one call (``compare.md``);
* ``run/``: a Hugging Face Trainer run fine-tuning SmolLM2-135M-Instruct (from its GGUF, rebuilt
  as a plain LlamaForCausalLM: transformers will not ``save_pretrained`` a GGUF-loaded model) on
  the standard library's source, its ``checkpoint-N`` folders saved into a temporary folder
  (never into the repository), then inspected as a run (``trajectory.md``).

The checkpoints come from their registry packages (:mod:`benchmarks.checkpoints`); each call runs
from their cache folder on relative paths, so the reports record no machine's paths.  Every text
is the default: text that ships with Python (the standard library's LICENSE.txt, then its
source).  A part whose stores answer the same request is not measured again (inspect resumes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import checkpoints  # noqa: E402  (benchmarks/checkpoints.py)

PARTS = ("minilm", "smollm2", "gemma3", "compare", "run")
# all-MiniLM-L6-v2 has 512 learned positions (max_position_embeddings).
MINILM_LENGTHS = "64,128,256,512"
# SmolLM2's lengths: 4x apart, below its 8192 trained context.
SMOLLM2_LENGTHS = "256,1024,4096"
# Gemma 3's: 5 layers in 6 attend a sliding window of 512 keys, whose keys stop growing there, so
# three lengths up to 512 fit those layers' slopes; its 32768 trained context bounds none.
GEMMA3_LENGTHS = "128,256,512,1024,4096"
# The fine-tuning run: batches of BATCH windows of WINDOW tokens of the standard library's
# source (the LM study's training files), AdamW at LR with a linear decay over STEPS, the
# model saved at SAVE_AT (log-spaced, so the first checkpoint is nearly the pretrained model).
RUN_NAME = "SmolLM2-135M-Instruct-stdlib"
STEPS, SAVE_AT, BATCH, WINDOW, LR, RUN_SEED = 40, (1, 5, 10, 20, 40), 2, 256, 1e-4, 0


def inspect(args: list[str], out: Path, cwd: Path) -> None:
    """``attnscale inspect ARGS --out OUT`` from ``cwd``, at nice 5 (the machine is shared)."""
    cmd = ["nice", "-n", "5", sys.executable, "-m", "attnscale", "inspect", *args,
           "--out", str(out)]
    print("$ (cd", cwd, "&&", " ".join(cmd[3:]) + ")", f"[load {os.getloadavg()[0]:.1f}]",
          flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    print(f"  {time.perf_counter() - t0:.0f} s, load average after {os.getloadavg()[0]:.1f}",
          flush=True)


def plain_llama(gguf: Path):
    """SmolLM2 from its GGUF as a plain ``LlamaForCausalLM`` (its config and dequantised
    weights copied into a model built from the config, which save_pretrained accepts), and the
    tokenizer stored in the file."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(config))
    model.load_state_dict(loaded.state_dict(), strict=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                           local_files_only=True)
    return model, tokenizer


def stdlib_windows(tokenizer, n_windows: int, window: int) -> list[dict]:
    """``n_windows`` windows of ``window`` tokens of the standard library's training files (the
    LM study's split: :mod:`attnscale.experiments.lm.data`), read in order from the start."""
    from attnscale.experiments.lm.data import is_validation, stdlib_files

    root, files = stdlib_files()
    ids: list[int] = []
    for path in files:
        if is_validation(path.relative_to(root).as_posix()):
            continue
        ids += tokenizer(path.read_text(encoding="utf-8", errors="replace"))["input_ids"]
        if len(ids) >= n_windows * window:
            break
    return [{"input_ids": ids[i * window:(i + 1) * window],
             "labels": ids[i * window:(i + 1) * window]} for i in range(n_windows)]


def train_run(folder: Path, steps: int = STEPS, save_at: tuple[int, ...] = SAVE_AT,
              batch: int = BATCH, window: int = WINDOW) -> Path:
    """Fine-tune SmolLM2-135M-Instruct with the Trainer, saving ``checkpoint-N`` (weights,
    config, tokenizer; no optimizer state) at the steps ``save_at`` into ``folder``."""
    import torch
    import transformers

    if all((folder / f"checkpoint-{s}" / "model.safetensors").is_file() for s in save_at):
        return folder
    model, tokenizer = plain_llama(checkpoints.smollm2())

    class SaveAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = state.global_step in save_at
            return control

    data = stdlib_windows(tokenizer, steps * batch, window)
    args = transformers.TrainingArguments(
        output_dir=str(folder), max_steps=steps, per_device_train_batch_size=batch,
        learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
        save_strategy="no", save_only_model=True, logging_steps=5, report_to=[],
        seed=RUN_SEED, data_seed=RUN_SEED, use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   processing_class=tokenizer, callbacks=[SaveAt()])
    torch.manual_seed(RUN_SEED)
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"  step {entry['step']}: loss {entry['loss']:.3f}", flush=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated parts ({', '.join(PARTS)})")
    parser.add_argument("--redraw", action="store_true",
                        help="redraw every page from its stores (attnscale inspect --from)")
    parser.add_argument("--run-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "attnscale-runs",
                        help="where the training run's checkpoints are saved (never the repo)")
    args = parser.parse_args(argv)
    parts = PARTS if args.only is None else tuple(args.only.split(","))
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(sorted(unknown))}")
    folders = {"minilm": checkpoints.MINILM_NAME, "smollm2": "SmolLM2-135M-Instruct.Q4_1",
               "gemma3": "gemma-3-270m-q4_k_m", "compare": "compare", "run": "run"}
    if args.redraw:
        for part in parts:
            cmd = [sys.executable, "-m", "attnscale", "inspect", "--from",
                   str(HERE / folders[part])]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return 0
    if args.run_dir.resolve().is_relative_to(REPO):
        parser.error("--run-dir must be outside the repository")
    cache = checkpoints.cache()
    models = {"minilm": checkpoints.minilm(), "smollm2": checkpoints.smollm2(),
              "gemma3": checkpoints.gemma3()}
    for part in parts:
        out = HERE / folders[part]
        if part == "minilm":
            inspect([models[part].name, "--lengths", MINILM_LENGTHS], out, cache)
        elif part in ("smollm2", "gemma3"):
            inspect([models[part].name, "--lengths",
                     SMOLLM2_LENGTHS if part == "smollm2" else GEMMA3_LENGTHS], out, cache)
        elif part == "compare":
            inspect([m.name for m in models.values()], out, cache)
        else:
            run = train_run(args.run_dir / RUN_NAME)
            inspect([run.name], out, run.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
