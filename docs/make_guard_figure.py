"""Regenerate docs/figures/guard_llama.png: the guard on a tiny random Llama at a high LR.

    python docs/make_guard_figure.py            # about a minute on a laptop CPU

Two runs of the same tiny Llama (hidden 32, 2 layers, 4 query / 2 key-value heads, built from a
config, nothing downloaded) on the same random token batches, Adam at lr 0.05: one with the guard
alone, one with the guard's QK-Clip at τ = 5 in K2's mode.  Both guards record every 2 steps and
raise a max-logit alarm above 8; the figure is ``attnscale guard plot`` of the two logs.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch
import transformers

import attnscale
from attnscale.guard import read_log
from attnscale.guard.plot import plot_guard
from attnscale.io import replace_atomically

OUT = Path(__file__).resolve().parent / "figures" / "guard_llama.png"
STEPS, LR, TAU, ALARM = 40, 0.05, 5.0, 8.0


def run(log: Path, **clip) -> None:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    data = torch.randint(0, 64, (STEPS, 4, 16), generator=torch.Generator().manual_seed(1))
    with attnscale.guard(model, optimizer=opt, every=2, log=log, alarm_logit=ALARM,
                         **clip) as g:
        for step, x in enumerate(data):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            g.step(step)


def main() -> None:
    warnings.simplefilter("ignore")  # the alarms fire: that is the point of the picture
    with tempfile.TemporaryDirectory() as tmp:
        plain, clipped = Path(tmp) / "guard only.jsonl", Path(tmp) / f"qk-clip tau={TAU:g}.jsonl"
        run(plain)
        run(clipped, qk_clip=TAU)
        fig = plot_guard({path.stem: read_log(path) for path in (plain, clipped)})
    fig.suptitle(f"tiny Llama, Adam lr {LR}: the guard alone and with QK-Clip (τ = {TAU:g}, "
                 f"K2 mode)\nx = alarm: max logit > {ALARM:g} (left), mean entropy under a "
                 "tenth of its first value (right)", fontsize=9)
    fig.tight_layout()
    # A file of the repository, not a run's output: replaced atomically, no manifest beside it.
    replace_atomically(OUT, lambda tmp: fig.savefig(tmp, dpi=110))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
