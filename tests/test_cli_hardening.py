"""Every command against the hardening classes: repeated list entries, output paths ('' / an
existing file / a folder attnscale did not write / --force), signals, and the monitor's bad inputs.

The class-wide tests walk the real argument parsers, so a new command (or a new list or output
option) is covered without editing this file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attnscale.cli as cli_module
import attnscale.experiments.recall.trainer as trainer
from attnscale.errors import ConfigError, check_choice
from attnscale.experiments.recall import RecallConfig, compare, train
from attnscale.experiments.recall.config import expand_grid
from attnscale.io import MANIFEST, STAGING_PREFIX
from attnscale.mechanisms import MECHANISMS
from children import sigint_default

SRC = str(Path(cli_module.__file__).parents[2])
# Small settings for options a command has, so that a check that fails on a regression fails fast.
MAIN = "import sys; from attnscale.cli import main; sys.exit(main())"
TINY = {"steps": "2", "batch_size": "2", "trials": "10", "n": "8"}


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) for every runnable command, recursing into command groups."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sub in subs[0].choices.items():
        yield from _leaves(sub, (*path, name))


LEAVES = list(_leaves(cli_module.build_parser()))


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len) if action.option_strings else action.dest


def _base_argv(parser: argparse.ArgumentParser, tmp: Path, skip: str | None = None) -> list[str]:
    """Required arguments (a fresh folder for paths) plus the tiny settings the parser takes."""
    argv: list[str] = []
    for a in parser._actions:
        if a.dest in (skip, "help") or isinstance(a, argparse._SubParsersAction):
            continue
        if not a.option_strings:                                 # a positional: a folder
            argv.append(str(tmp / f"positional-{a.dest}"))
        elif a.required:
            argv += [a.option_strings[0], str(tmp / f"required-{a.dest}")]
        elif a.dest in TINY:
            argv += [a.option_strings[0], TINY[a.dest]]
    return argv


@pytest.mark.parametrize("words", [pytest.param(w, id=" ".join(w)) for w, _ in LEAVES])
def test_every_command_has_worked_examples(cli, words):
    code, out, _ = cli(*words, "--help")
    assert code == 0 and f"attnscale {' '.join(words)}" in out.split("examples:", 1)[1]


# ---------------------------------------------------------------------------------------------
# Repeated list entries: every comma-separated option of every command


def _list_options():
    for words, parser in LEAVES:
        for a in parser._actions:
            if a.help and "comma-separated" in a.help:
                yield pytest.param(words, parser, a, id=f"{' '.join(words)} {_flag(a)}")


LIST_OPTIONS = list(_list_options())


def test_the_list_options_are_found():
    found = {(" ".join(p.values[0]), _flag(p.values[2])) for p in LIST_OPTIONS}
    assert {("compare", "--mechanisms"), ("compare", "--seed"), ("study recall", "--d-k"),
            ("study recall", "--seed"), ("study recall", "--mechanisms")} <= found


@pytest.mark.parametrize("words, parser, action", LIST_OPTIONS)
def test_every_list_option_refuses_a_repeated_entry(cli, tmp_path, monkeypatch, words, parser,
                                                    action):
    monkeypatch.chdir(tmp_path)
    default = action.default if action.default is not None else \
        re.search(r"\(default: ([^)]*)\)", action.help).group(1)
    first = str(default).split(",")[0]
    first = next(iter(MECHANISMS)) if first == "all" else first
    argv = [*words, *_base_argv(parser, tmp_path, skip=action.dest),
            _flag(action), f"{first},{first}"]
    code, out, err = cli(*argv)
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and "more than once" in err and first in err, err
    assert any(f in err for f in action.option_strings), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", ["cap=30", "cap=30.0"])
def test_option_given_twice_is_refused(cli, option):
    code, _, err = cli("train", "--mechanism", "softcap", "--option", "cap=20", "--option", option,
                       "--steps", "2")
    assert code == 2 and "--option" in err and "'cap' more than once" in err, err


@pytest.mark.parametrize("value", ["True", "true", "nan", "inf", "[30]"])
def test_option_value_that_is_not_a_number_is_refused(cli, value):
    code, _, err = cli("train", "--mechanism", "softcap", "--option", f"cap={value}",
                       "--steps", "2")
    assert code == 2 and "cap" in err and err.count("\n") == 1, err


def test_api_lists_refuse_repeats_before_training(monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(trainer, "train_runs", no_training)
    import attnscale.experiments.recall.experiments as experiments
    monkeypatch.setattr(experiments, "run_all", no_training)
    cases = [
        (lambda: compare(["scaled", "scaled"]), "mechanisms.*'scaled'"),
        (lambda: compare(["scaled"], seeds=[0, 0]), "seeds.*0"),
        (lambda: expand_grid(RecallConfig(), seed=[2, 2]), "seed.*2"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            fn()


@pytest.mark.parametrize("config, pattern", [
    (RecallConfig(mechanism="softcap", options={"cap": True}), "cap must be a number"),
    (RecallConfig(d_k=True), "d-k must be an integer"),
    (RecallConfig(seed=False), "seed must be an integer"),
    (RecallConfig(mechanism="scaledd"), "Unknown mechanism 'scaledd'.*Did you mean: scaled"),
    (RecallConfig(mechanism="softcap", options={"capp": 3}), "Unknown option 'capp'"),
])
def test_recall_config_refuses_bools_and_unknown_names(config, pattern):
    with pytest.raises(ConfigError, match=pattern):
        train(config, steps=2, batch_size=2)


def test_check_choice_message_reads_well():
    with pytest.raises(ConfigError) as info:
        check_choice("over", "bogus", ("head", "model"))
    assert str(info.value) == "over must be one of head, model; got 'bogus'."
    with pytest.raises(ConfigError, match=r"^--mechanisms: unknown mechanism 'scaeld'\. "
                                          r"Did you mean: scaled\? Choices: scaled, unscaled\.$"):
        check_choice("--mechanisms", "scaeld", ("scaled", "unscaled"), "mechanism")


# ---------------------------------------------------------------------------------------------
# Output options: '' / an existing file / a folder attnscale did not write, before any work


def _output_options():
    for words, parser in LEAVES:
        for out in parser.get_default("outputs") or ():
            yield pytest.param(words, parser, out, id=f"{' '.join(words)} {out.flag}")


OUTPUT_OPTIONS = list(_output_options())


@pytest.mark.parametrize("words, parser", [pytest.param(w, p, id=" ".join(w)) for w, p in LEAVES])
def test_every_path_like_option_is_a_checked_output(words, parser):
    """An option named like an output path must be registered, or nothing checks it."""
    registered = {o.dest for o in parser.get_default("outputs") or ()}
    for a in parser._actions:
        if any(f.startswith(("--out", "--plot", "--save")) for f in a.option_strings):
            assert a.dest in registered, (words, a.option_strings)
    if registered:
        assert any("--force" in a.option_strings for a in parser._actions)


def test_the_output_options_are_found():
    found = {(" ".join(p.values[0]), p.values[2].flag) for p in OUTPUT_OPTIONS}
    assert {("reproduce", "--out"), ("study recall", "--out"), ("monitor", "--out"),
            ("compare", "--output"), ("compare", "--plot"), ("train", "--output")} <= found


@pytest.fixture
def no_work(monkeypatch):
    """Every command's work replaced by a recorder: these tests are about path checks."""
    calls = []
    real = cli_module.build_parser

    def build():
        parser = real()
        for _, leaf in _leaves(parser):
            leaf.set_defaults(func=lambda args: calls.append(args) or 0)
        return parser

    monkeypatch.setattr(cli_module, "build_parser", build)
    return calls


def _case(tmp: Path, out, case: str) -> tuple[Path | str, str]:
    """The path for ``case`` and what a file there must still hold afterwards."""
    if case == "empty":
        return "", ""
    suffix = out.suffixes[0] if out.suffixes else ".json"
    if case == "user-file":
        path = tmp / f"user{'.png' if '.png' in (out.suffixes or ()) else suffix}"
        path.write_text("the user's")
        return path, "the user's"
    folder = tmp / "user-folder"                     # a folder attnscale did not write
    folder.mkdir()
    for name in ("notes.txt", *out.files):
        (folder / name).write_text("the user's")
    return folder, "the user's"


@pytest.mark.parametrize("case", ["empty", "user-file", "user-folder"])
@pytest.mark.parametrize("words, parser, out", OUTPUT_OPTIONS)
def test_every_output_option_is_checked_before_any_work(cli, tmp_path, monkeypatch, no_work,
                                                        words, parser, out, case):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    path, content = _case(tmp_path, out, case)
    argv = [*words, *_base_argv(parser, tmp_path, skip=out.dest), out.flag, str(path)]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    code, stdout, err = cli(*argv)
    assert code == 2 and stdout == "" and no_work == [], err
    assert err.count("\n") == 1 and out.flag in err, err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    if content:
        files = [path] if path.is_file() else [path / "notes.txt", *(path / f for f in out.files)]
        assert all(f.read_text() == content for f in files)
    if case != "empty" and (Path(path).is_file() == (out.kind == "file")):
        code, _, err = cli(*argv, "--force")                # the right kind: --force lets it in
        assert code == 0 and len(no_work) == 1, err


@pytest.mark.parametrize("argv, fragment", [
    (("compare", "--plot", "{tmp}/x.txt", "--output", "{tmp}/z.json"), "--plot"),
    (("compare", "--output", "{tmp}"), "is a directory"),
    (("compare", "--output", "{tmp}/a.png", "--plot", "{tmp}/a.png"), "same path"),
    (("train", "--output", "/proc/attnscale-x.json"), "not writable"),
    (("compare", "--output", ""), "--output must be a path"),
    (("compare", "--plot", ""), "--plot must be a path"),
    (("reproduce", "--out", ""), "--out must be a path"),
    (("study", "recall", "--out", ""), "--out must be a path"),
    (("monitor", "{tmp}", "--out", ""), "--out must be a path"),
])
def test_bad_output_paths_are_refused_before_any_work(cli, tmp_path, no_work, argv, fragment):
    code, out, err = cli(*(a.format(tmp=tmp_path) for a in argv))
    assert code == 2 and out == "" and no_work == [] and fragment in err, err
    assert not (tmp_path / "z.json").exists()


TINY_STUDY = ("--mechanisms", "scaled", "--d-k", "4", "--seed", "0", "--pairs", "4", "--steps",
              "2", "--batch-size", "2")


def test_study_replaces_only_its_own_files_and_force_overwrites(cli, tmp_path):
    out = tmp_path / "study"
    assert cli("study", "recall", "--out", str(out), *TINY_STUDY)[0] == 0
    (out / "notes.txt").write_text("mine")
    code, _, err = cli("study", "recall", "--out", str(out), *TINY_STUDY)  # its own files: fine
    assert code == 0, err
    (out / "fragment.md").write_text("edited by the user")
    code, _, err = cli("study", "recall", "--out", str(out), *TINY_STUDY)
    assert code == 2 and "fragment.md" in err and "--force" in err
    assert (out / "fragment.md").read_text() == "edited by the user"
    code, _, err = cli("study", "recall", "--out", str(out), *TINY_STUDY, "--force")
    assert code == 0, err
    assert (out / "fragment.md").read_text().startswith("Every registered mechanism")
    assert (out / "notes.txt").read_text() == "mine"
    runs = json.loads((out / "study_recall.json").read_text())["runs"]
    assert RecallConfig(**runs[0]["config"]).validated().d_k == 4      # re-runnable from it


def test_compare_output_overwrites_only_its_own_file(cli, tmp_path):
    target = tmp_path / "runs.json"
    argv = ("compare", "--mechanisms", "scaled", "--steps", "2", "--batch-size", "2", "--d-k",
            "4", "--output", str(target))
    assert cli(*argv)[0] == 0
    first = json.loads(target.read_text())
    assert first["runs"][0]["config"]["d_k"] == 4 and first["runs"][0]["config"]["options"] == {}
    assert cli(*argv)[0] == 0                              # attnscale's file: replaced
    target.write_text("user")
    assert cli(*argv)[0] == 2 and target.read_text() == "user"
    assert cli(*argv, "--force")[0] == 0 and json.loads(target.read_text())["runs"]


def test_successful_write_removes_stale_staging(cli, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"{STAGING_PREFIX}{dead}-killed"
    stale.mkdir()
    (stale / "figure1_saturation.png").write_bytes(b"partial")
    code, _, err = cli("train", "--steps", "2", "--batch-size", "2", "--d-k", "4", "--output",
                       str(tmp_path / "run.json"))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "run.json"]


def test_sigterm_in_process_exits_143_and_writes_nothing(cli, tmp_path, monkeypatch):
    real, calls = trainer.StackedRecall.forward, []

    def forward(self, idx):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, idx)

    monkeypatch.setattr(trainer.StackedRecall, "forward", forward)
    before = signal.getsignal(signal.SIGTERM)
    code, _, err = cli("compare", "--steps", "50", "--batch-size", "2", "--d-k", "4",
                       "--output", str(tmp_path / "runs.json"))
    assert code == 143 and "terminated" in err
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_reproduce_leaves_nothing(tmp_path, sig, code):
    """The real command in its own process, signalled once its staging folder exists."""
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-c", MAIN, "reproduce", "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    try:
        deadline = time.monotonic() + 120
        while not (out.is_dir() and any(p.name.startswith(STAGING_PREFIX) for p in out.iterdir())):
            assert proc.poll() is None and time.monotonic() < deadline, "no staging folder"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert not out.exists()             # created by this run, removed with its staging


# ---------------------------------------------------------------------------------------------
# attnscale monitor: bad inputs are one-line errors, checked before any output


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "model")
    return root / "model"


def _copy(model: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in model.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


@pytest.mark.parametrize("case, fragment", [
    ("text-not-utf8", "--text"),
    ("config-list", "config.json must hold a JSON object"),
    ("config-broken", "config.json is not valid JSON"),
    ("truncated-weights", "cannot load MODEL_DIR"),
    ("seq-len-too-long", "--seq-len 33 exceeds the model's maximum of 32"),
    ("seed-negative", "--seed must be >= 0"),
    ("out-is-a-file", "--out"),
    ("mechanism-unknown", "--mechanism: Unknown mechanism 'qknrom'"),
])
def test_monitor_bad_inputs(cli, tiny_model, tmp_path, case, fragment):
    model = tiny_model
    argv = ["--seq-len", "8", "--out", str(tmp_path / "out")]
    if case == "text-not-utf8":
        (tmp_path / "t.txt").write_bytes(b"caf\xe9 latin-1")
        argv += ["--text", str(tmp_path / "t.txt")]
    elif case.startswith("config"):
        model = _copy(tiny_model, tmp_path / "m")
        (model / "config.json").write_text("[1, 2]" if case == "config-list" else "{")
    elif case == "truncated-weights":
        model = _copy(tiny_model, tmp_path / "m")
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    elif case == "seq-len-too-long":
        argv += ["--seq-len", "33"]
    elif case == "seed-negative":
        argv += ["--seed", "-1"]
    elif case == "out-is-a-file":
        (tmp_path / "afile").write_text("x")
        argv[argv.index("--out") + 1] = str(tmp_path / "afile")
    elif case == "mechanism-unknown":
        argv += ["--mechanism", "qknrom"]
    code, out, err = cli("monitor", str(model), *argv)
    assert code == 2 and out == "", (out, err)        # no table printed before the error
    assert err.count("\n") == 1 and "Traceback" not in err and fragment in err, err
    assert not (tmp_path / "out").exists()
