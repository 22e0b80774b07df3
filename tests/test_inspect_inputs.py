"""attnscale inspect's inputs: .gguf files, training-run folders of checkpoint-N, several models
side by side and several lengths, with one copy of the weights held (the init measured on the
loaded model, re-initialised in place).

The GGUF is written in the test with the ``gguf`` package from a tiny Llama's weights, laid out
as llama.cpp's converter lays them (tests/gguf_files.py), so transformers' own GGUF loader reads
it back; the run folder is saved by a tiny Hugging Face Trainer run.  The figures are stubbed
(a PNG signature each): their drawing is tested in tests/test_inspect_analyses.py and
tests/test_inspect.py, and here the inputs, the stores and the pages' text are the subject.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers

from attnscale import hf
from attnscale.cli import main
from attnscale.errors import ConfigError
from attnscale.inspect import multi
from attnscale.inspect.inputs import fresh_model, reinitialise
from attnscale.inspect.records import COMPARED
from attnscale.inspect.report import load
from attnscale.inspect.sources import load_checkpoint, resolve

from gguf_files import write_llama_gguf

SETTINGS = dict(block=64, saturated_weight=0.75, saturated_entropy=0.1)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def stub_figures():
    """Every inspect figure written as a bare PNG signature, for the whole module."""
    from attnscale.inspect import compare, lengths, report, trajectory

    def stub(*args, **kwargs):
        path = Path(args[1])
        path.write_bytes(PNG)
        return path

    with pytest.MonkeyPatch.context() as patch:
        for module, name in ((report, "draw_heatmaps"), (report, "draw_scatter"),
                             (compare, "draw_compare"), (lengths, "draw_lengths"),
                             (trajectory, "draw_trajectory")):
            patch.setattr(module, name, stub)
        yield


def tiny_llama(seed: int = 0, layers: int = 2, **extra) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      **extra)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama as a save_pretrained folder and as a GGUF of the same weights, a tiny
    Mistral with a sliding window, and a run folder of three Trainer checkpoints."""
    root = tmp_path_factory.mktemp("models")
    llama = tiny_llama(seed=3)
    llama.save_pretrained(root / "llama")
    write_llama_gguf(llama, root / "weights.gguf")
    mistral = transformers.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128,
                                         sliding_window=24)
    torch.manual_seed(4)
    transformers.MistralForCausalLM(mistral).save_pretrained(root / "mistral")
    _trainer_run(root / "run")
    return {"llama": root / "llama", "gguf": root / "weights.gguf",
            "mistral": root / "mistral", "run": root / "run", "root": root}


def _trainer_run(folder: Path) -> None:
    """Three checkpoints (steps 4, 8, 12) of a tiny Llama trained by the HF Trainer."""
    model = tiny_llama(seed=5).train()
    ids = torch.randint(0, 96, (48, 32), generator=torch.Generator().manual_seed(6))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(folder), max_steps=12, save_steps=4, per_device_train_batch_size=4,
        learning_rate=3e-2, report_to=[], logging_strategy="no", use_cpu=True,
        save_only_model=True, disable_tqdm=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()


def _stats(payload: dict) -> dict[str, torch.Tensor]:
    rows = payload["records"]
    return {k: torch.tensor([math.nan if r[k] is None else r[k] for r in rows],
                            dtype=torch.float64)
            for k in (*COMPARED, *(f"init_{s}" for s in COMPARED))}


def run(sources, out: Path, lengths=(32,), **kw) -> list[dict]:
    return multi.inspect_paths(resolve(sources), out, lengths=list(lengths), **SETTINGS, **kw)


def test_gguf_equals_the_same_weights_from_a_folder(models, tmp_path):
    (folder,) = run([models["llama"]], tmp_path / "folder")
    (gguf,) = run([models["gguf"]], tmp_path / "gguf")
    assert gguf["meta"]["gguf"] == "weights.gguf" and gguf["meta"]["name"] == "weights"
    assert gguf["meta"]["token_ids"] == folder["meta"]["token_ids"]
    a, b = _stats(folder), _stats(gguf)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-7, equal_nan=True,
                                   msg=key)
    assert gguf["owner"] == folder["owner"]


def test_gguf_loads_into_the_language_model_class(models):
    model, tokenizer = load_checkpoint(models["gguf"], lm_head=True)
    reference = transformers.LlamaForCausalLM.from_pretrained(models["llama"]).eval()
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    assert tokenizer is None  # this file stores no tokenizer: random ids are read instead
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION


@pytest.mark.parametrize("config", [
    dict(model_type="llama"), dict(model_type="bert"), dict(model_type="gemma3_text")])
def test_reinitialise_in_place_draws_the_fresh_models_weights(config):
    """One copy of the weights: the init measured on the loaded model re-initialised in place
    is bit for bit the init of a second, fresh model under the same seed; every tensor is
    redrawn, and each one's spread is ``from_config``'s, within five standard errors of the
    difference of two sample stds (Gaussian draws; uniform ones vary less)."""
    hf.register()
    kind = config["model_type"]
    cfg = transformers.AutoConfig.for_model(
        kind, vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, **({"num_key_value_heads": 2, "head_dim": 16}
                                  if kind != "bert" else {}))
    torch.manual_seed(11)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="attnscale")
    fresh = fresh_model(model, seed=7).state_dict()
    torch.manual_seed(7)
    built = transformers.AutoModel.from_config(cfg, attn_implementation="attnscale").state_dict()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    reinitialise(model, seed=7)
    mine = model.state_dict()
    for key, value in fresh.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=0, msg=key)
    for key, value in built.items():
        if value.is_floating_point() and value.numel() > 1 and float(value.std()) > 0:
            assert not torch.equal(mine[key], trained[key]), key     # redrawn
            if value.numel() >= 256:
                want, got = float(value.double().std()), float(mine[key].double().std())
                # two independent sample stds differ with sd · √(2 · 1/(2n)) = sd / √n
                assert abs(got - want) <= 5 * want / math.sqrt(value.numel()), (key, got, want)
        else:
            torch.testing.assert_close(mine[key], value, msg=key)   # constants: ones, zeros


@pytest.fixture(scope="module")
def inspected(models, tmp_path_factory) -> tuple[Path, list[dict]]:
    """One inspection of a model, a windowed model and a run at two lengths."""
    out = tmp_path_factory.mktemp("inspected") / "out"
    return out, run([models["llama"], models["mistral"], models["run"]], out, lengths=(16, 32))


def test_run_folder_gives_trajectories_in_step_order(inspected):
    out, payloads = inspected
    mine = [p for p in payloads if p["meta"].get("step") and p["meta"]["seq_len"] == 16]
    assert [p["meta"]["step"] for p in mine] == [4, 8, 12]
    assert [p["meta"]["name"] for p in mine] == [f"run checkpoint-{s}" for s in (4, 8, 12)]
    # the init (step 0) is measured once and is every checkpoint's
    inits = [_stats(p) for p in mine]
    for stats in inits[1:]:
        for key in (f"init_{s}" for s in COMPARED):
            torch.testing.assert_close(stats[key], inits[0][key], rtol=0, atol=0,
                                       equal_nan=True)
    # the checkpoints differ: training moved the logits
    assert not torch.equal(_stats(mine[0])["logit_std"], _stats(mine[-1])["logit_std"])
    page = (out / "run" / multi.TRAJECTORY_MD).read_text(encoding="utf-8")
    assert "steps 4, 8, 12" in page and (out / "run" / multi.TRAJECTORY_PNG).stat().st_size > 0
    for step in (4, 8, 12):
        assert load(out / "run" / f"checkpoint-{step}" / "n32")["meta"]["step"] == step


def test_the_logit_std_growth_splits_into_its_factors(inspected):
    """Per head, the factors' log-ratios over the run sum to the logit std's, to rounding."""
    from attnscale.inspect.trajectory import trajectory_rows

    _, payloads = inspected
    mine = [p for p in payloads if p["meta"].get("step") and p["meta"]["seq_len"] == 32]
    rows = trajectory_rows([(p["meta"]["step"], p) for p in mine])
    last = [r for r in rows if r["step"] == 12]
    assert len(last) == 8
    growth = torch.tensor([r["log_growth"] for r in last], dtype=torch.float64)
    parts = torch.tensor([r["log_scale"] + r["log_q_rms"] + r["log_k_rms"] + r["log_coherence"]
                          for r in last], dtype=torch.float64)
    assert growth.abs().max() > 0.1  # training moved every head's temperature
    torch.testing.assert_close(parts, growth, rtol=1e-9, atol=1e-12)


def test_models_side_by_side_and_lengths(inspected):
    out, payloads = inspected
    assert [(p["meta"]["name"], p["meta"]["seq_len"]) for p in payloads[:4]] == [
        ("llama", 16), ("llama", 32), ("mistral", 16), ("mistral", 32)]
    # the same text prefix at every length
    ids = [p["meta"]["token_ids"][0] for p in payloads[:2]]
    assert ids[0] == ids[1][:16]
    compare = (out / multi.COMPARE_MD).read_text(encoding="utf-8")
    assert "| llama |" in compare and "| mistral |" in compare
    assert "| run checkpoint-12 |" in compare  # a run by its last checkpoint
    lengths = (out / "mistral" / multi.LENGTHS_MD).read_text(encoding="utf-8")
    assert "window 24" in lengths  # past the window the keys stop growing, and it is said
    n32 = load(out / "mistral" / "n32")
    assert {r["n_keys"] for r in n32["records"]} == {24}
    index = json.loads((out / multi.INDEX).read_text(encoding="utf-8"))
    assert [e["folder"] for e in index["entries"]][:3] == ["llama/n16", "llama/n32",
                                                           "mistral/n16"]


def test_redraw_and_resume(models, inspected, tmp_path, monkeypatch):
    import shutil
    out = tmp_path / "out"
    shutil.copytree(inspected[0], out)
    page = (out / multi.COMPARE_MD).read_bytes()
    report = (out / "llama" / "n16" / "report.md").read_bytes()
    (out / multi.COMPARE_MD).unlink()
    (out / "llama" / "n16" / "report.md").write_text("edited", encoding="utf-8")
    assert main(["inspect", "--from", str(out), "--force"]) == 0
    assert (out / multi.COMPARE_MD).read_bytes() == page
    assert (out / "llama" / "n16" / "report.md").read_bytes() == report

    def refuse(*args, **kwargs):
        raise AssertionError("a stored report was measured again")

    monkeypatch.setattr(multi, "load_checkpoint", refuse)
    again = run([models["llama"], models["mistral"], models["run"]], out, lengths=(16, 32))
    assert again == json.loads(json.dumps(inspected[1]))  # as stored
    with pytest.raises(AssertionError, match="measured again"):  # another seed is a new request
        run([models["llama"], models["mistral"], models["run"]], out, lengths=(16, 32), seed=1)


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()  # what building the inputs printed is not the command's
    code = main(["inspect", *map(str, argv)])
    err = capsys.readouterr().err.strip()
    return code, err


def test_cli_reads_a_gguf(models, tmp_path, capsys):
    code, err = _cli(capsys, models["gguf"], "--seq-len", 16, "--out", tmp_path / "o")
    assert code == 0, err
    assert load(tmp_path / "o")["meta"]["gguf"] == "weights.gguf"


def _truncated(models, tmp_path) -> Path:
    data = models["gguf"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 512])
    return path


def _other_architecture(models, tmp_path) -> Path:
    import gguf
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "no-such-arch")
    writer.add_tensor("x", torch.zeros(4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _empty_run(models, tmp_path) -> Path:
    (tmp_path / "empty-run" / "logs").mkdir(parents=True)
    return tmp_path / "empty-run"


def _two_architectures(models, tmp_path) -> Path:
    import shutil
    run_dir = tmp_path / "mixed"
    shutil.copytree(models["llama"], run_dir / "checkpoint-1")
    tiny_llama(layers=3).save_pretrained(run_dir / "checkpoint-2")
    return run_dir


@pytest.mark.parametrize("case,argv,needle", [
    ("truncated gguf", lambda m, t: [_truncated(m, t)], "truncated"),
    ("not a gguf", lambda m, t: [_not_gguf(t)], "not a GGUF file"),
    ("architecture", lambda m, t: [_other_architecture(m, t)], "'no-such-arch'"),
    ("empty run", lambda m, t: [_empty_run(m, t)], "checkpoint-N"),
    ("two architectures", lambda m, t: [_two_architectures(m, t)], "num_hidden_layers"),
    ("repeated path", lambda m, t: [m["llama"], str(m["llama"]) + "/"], "given twice"),
    ("empty path", lambda m, t: [""], "must be a path"),
    ("missing", lambda m, t: [t / "nope"], "does not exist"),
    ("too long", lambda m, t: [m["gguf"], "--lengths", "64,256"], "256"),
    ("repeated length", lambda m, t: [m["llama"], "--lengths", "16,32,16"], "more than once"),
    ("both", lambda m, t: [m["llama"], "--lengths", "16,32", "--seq-len", "8"], "not both"),
])
def test_bad_inputs_are_one_line_errors(models, tmp_path, capsys, case, argv, needle):
    code, err = _cli(capsys, *argv(models, tmp_path), "--out", tmp_path / "out")
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "out" / "records.json").exists()


def _not_gguf(tmp_path) -> Path:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    return path


def test_gguf_without_the_package_names_the_extra(models, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ConfigError, match=r"attnscale\[gguf\]"):
        resolve([models["gguf"]])
