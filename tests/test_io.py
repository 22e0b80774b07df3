"""attnscale.io: output-path checks, the output-folder policy, staged atomic writes, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnscale import io
from attnscale.errors import ConfigError
from attnscale.io import MANIFEST, STAGING_PREFIX
from children import sigint_default


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------------------------
# check_output_path


@pytest.mark.parametrize("kind", ["file", "dir"])
@pytest.mark.parametrize("path", ["", "  "])
def test_empty_path_is_a_config_error_naming_the_parameter(path, kind):
    with pytest.raises(ConfigError, match="^--out must be a path"):
        io.check_output_path("--out", path, kind=kind)


def test_file_given_a_directory_and_dir_given_a_file(tmp_path):
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(ConfigError, match="--output .* is a directory"):
        io.check_output_path("--output", tmp_path, kind="file")
    with pytest.raises(ConfigError, match="--out .* is a file"):
        io.check_output_path("--out", tmp_path / "f.json", kind="dir")


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_parent_that_is_a_file_or_not_writable(tmp_path, kind):
    (tmp_path / "blocker").write_text("x")
    with pytest.raises(ConfigError, match="cannot be created"):
        io.check_output_path("--out", tmp_path / "blocker" / "sub" / "x.json", kind=kind)
    with pytest.raises(ConfigError, match="not writable"):
        io.check_output_path("--out", "/proc/attnscale-x/y.json", kind=kind)
    assert _names(tmp_path) == ["blocker"]                     # created nothing


def test_figure_suffix_is_checked(tmp_path):
    assert {".png", ".pdf", ".svg"} <= set(io.figure_suffixes())
    with pytest.raises(ConfigError, match="--plot .*x.txt.* must end in one of .*png"):
        io.check_output_path("--plot", tmp_path / "x.txt", suffixes=io.figure_suffixes())
    assert io.check_output_path("--plot", tmp_path / "x.PDF", suffixes=io.figure_suffixes()) \
        == tmp_path / "x.PDF"


def test_existing_user_file_is_refused_unless_force(tmp_path):
    user = tmp_path / "runs.json"
    user.write_text("mine")
    with pytest.raises(ConfigError, match="attnscale did not write it.*force=True"):
        io.check_output_path("output", user)
    assert io.check_output_path("--output", user, force=True) == user
    with pytest.raises(ConfigError, match="did not write"):
        io.atomic_write(user, "theirs", param="--output")
    assert user.read_text() == "mine"
    io.atomic_write(user, "theirs", force=True)
    assert user.read_text() == "theirs" and io.owned(user)
    io.check_output_path("--output", user)                    # now attnscale's: replaceable


def _refusal(call) -> str:
    with pytest.raises(ConfigError) as caught:
        call()
    return str(caught.value)


def test_every_refusal_spells_force_as_the_interface_that_raised_it(cli, tmp_path):
    # From Python the override is the keyword force=True; from the command line, --force.
    from attnscale import sweep
    from attnscale.errors import command_line
    user = tmp_path / "runs.json"
    user.write_text("mine")
    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    calls = [lambda: io.check_output_path("output", user),
             lambda: io.check_output_path("out", folder, kind="dir"),
             lambda: io.check_output_path("out", tmp_path, kind="dir", files=["runs.json"]),
             lambda: io.atomic_write(user, "x", param="output"),
             lambda: sweep.run("saturation", {"d_k": [4], "mechanism": ["scaled"]}, folder,
                                       fixed={"n": 4, "trials": 2})]
    for call in calls:
        text = _refusal(call)
        assert "pass force=True" in text and "--force" not in text, text
        with command_line():
            text = _refusal(call)
        assert "pass --force" in text and "force=True" not in text, text
    assert _names(folder) == ["notes.txt"]
    # a sweep.json edited by hand: sweep.resume(force=True) / sweep --resume --force
    out = tmp_path / "s"
    sweep.run("saturation", {"d_k": [4], "mechanism": ["scaled"]}, out, fixed={"n": 4, "trials": 2}, workers=1,
              show_progress=False)
    spec = out / "sweep.json"
    spec.write_text(spec.read_text().replace('"trials": 2', '"trials":  2'))
    text = _refusal(lambda: sweep.resume(out, workers=1, show_progress=False))
    assert "pass force=True" in text and "--force" not in text, text
    code, _, err = cli("sweep", "--resume", str(out), "--workers", "1")
    assert code == 2 and "pass --force" in err and "force=True" not in err, err
    text = _refusal(lambda: sweep.resume(out, grid={"d_k": [4, 8]}, force=True, workers=1))
    assert "pass extend=True" in text and "--extend" not in text, text


def test_atomic_write_refuses_a_directory_even_with_force(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="--output .* is a directory"):
        io.atomic_write(tmp_path / "d", "{}", param="--output", force=True)


def test_a_file_attnscale_wrote_then_the_user_edited_is_theirs(tmp_path):
    path = io.atomic_write(tmp_path / "a.json", "{}")
    assert io.owned(path)
    path.write_text('{"edited": 1}')
    assert not io.owned(path)
    with pytest.raises(ConfigError, match="did not write"):
        io.check_output_path("--output", path)


def test_folder_policy(tmp_path):
    io.check_output_path("--out", tmp_path / "new", kind="dir")           # new: fine
    io.check_output_path("--out", tmp_path, kind="dir")                   # empty: fine
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds files attnscale did not write .*notes.txt"):
        io.check_output_path("--out", tmp_path, kind="dir")
    io.check_output_path("--out", tmp_path, kind="dir", force=True)


def test_folder_attnscale_wrote_replaces_only_its_own_files(tmp_path):
    with io.staged_dir(tmp_path) as staging:
        (staging / "report.md").write_text("v1")
    (tmp_path / "notes.txt").write_text("mine")           # a user file beside ours: not in the way
    io.check_output_path("--out", tmp_path, kind="dir", files=["report.md"])
    with io.staged_dir(tmp_path) as staging:
        (staging / "report.md").write_text("v2")
    assert (tmp_path / "report.md").read_text() == "v2" and (tmp_path / "notes.txt").exists()
    with pytest.raises(ConfigError, match="notes.txt.*did not write"):
        io.check_output_path("--out", tmp_path, kind="dir", files=["report.md", "notes.txt"])
    with pytest.raises(ConfigError, match="notes.txt"):
        with io.staged_dir(tmp_path) as staging:
            (staging / "notes.txt").write_text("ours")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert _names(tmp_path) == [MANIFEST, "notes.txt", "report.md"]
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert list(manifest["files"]) == ["report.md"]


# ---------------------------------------------------------------------------------------------
# staged and atomic writes


def test_staged_dir_moves_nested_files_and_records_them(tmp_path):
    out = tmp_path / "out"
    with io.staged_dir(out) as staging:
        assert staging.parent == out and staging.name.startswith(STAGING_PREFIX)
        (staging / "a.txt").write_text("a")
        (staging / "figs").mkdir()
        (staging / "figs" / "b.png").write_bytes(b"png")
    assert _names(out) == [MANIFEST, "a.txt", "figs"]
    assert io.owned(out / "a.txt") and io.owned(out / "figs" / "b.png")


def test_a_signal_as_the_staging_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C handled the moment the staging folder's mkdir returns (Python runs a pending
    signal's handler there) still removes the staging folder and the folder it was made in."""
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if self.name.startswith(STAGING_PREFIX):
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt), io.staged_dir(out):
        pass
    assert not out.exists()


@pytest.mark.parametrize("staged", [False, True])
def test_a_signal_between_a_file_and_its_manifest_entry_waits_for_both(tmp_path, monkeypatch,
                                                                      staged):
    # Ctrl-C as the file lands: it is delivered once the manifest lists the file, so the file is
    # attnscale's (a resume does not refuse it as changed by hand).
    rename = os.replace

    def interrupted(src, dst):
        rename(src, dst)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(io.os, "replace", interrupted)
    target = tmp_path / "out" / "spec.json"
    # Ctrl-C raises KeyboardInterrupt here even where a background shell ignores it
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            if staged:
                with io.staged_dir(tmp_path / "out") as staging:
                    (staging / "spec.json").write_text("{}")
            else:
                io.atomic_write(target, "{}")
    finally:
        restored = signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(io.os, "replace", rename)
    assert target.read_text() == "{}" and io.owned(target)
    assert restored is signal.default_int_handler


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt(), io.Terminated()])
def test_staged_dir_leaves_nothing_on_failure(tmp_path, exc):
    out = tmp_path / "out"
    with pytest.raises(type(exc)):
        with io.staged_dir(out) as staging:
            (staging / "half.png").write_bytes(b"\x89PNG")
            raise exc
    assert not out.exists()                    # created by the call, so removed again
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(type(exc)):
        with io.staged_dir(out, force=True) as staging:
            (staging / "half.png").write_bytes(b"\x89PNG")
            raise exc
    assert _names(out) == ["keep.txt"]


def test_atomic_write_callback_gets_a_temporary_path_with_the_extension(tmp_path):
    seen = []

    def write(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_bytes(b"data")

    io.atomic_write(tmp_path / "fig.svg", write)
    assert seen[0].suffix == ".svg" and seen[0].parent == tmp_path and seen[0] != tmp_path / "fig.svg"
    assert _names(tmp_path) == [MANIFEST, "fig.svg"]

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        io.atomic_write(tmp_path / "other.svg", fail)
    assert _names(tmp_path) == [MANIFEST, "fig.svg"]


def test_success_removes_stale_staging_of_dead_processes_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f"{STAGING_PREFIX}{dead.stdout.strip()}-dead"
    stale.mkdir()
    (stale / "partial.png").write_bytes(b"x")
    legacy = tmp_path / f"{STAGING_PREFIX}abc123"         # an older attnscale's naming
    legacy.mkdir()
    stale_tmp = tmp_path / f"{STAGING_PREFIX}{dead.stdout.strip()}-ab-runs.json"
    stale_tmp.write_text("{")
    live = tmp_path / f"{STAGING_PREFIX}{os.getppid()}-live"   # a running process: kept
    live.mkdir()
    io.check_output_path("--out", tmp_path, kind="dir")      # staging is not a user file
    with io.staged_dir(tmp_path) as staging:
        (staging / "r.md").write_text("r")
    assert _names(tmp_path) == [MANIFEST, live.name, "r.md"]


def test_sigterm_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with io.sigterm_as_exit():
        assert signal.getsignal(signal.SIGTERM) is not before
        with pytest.raises(io.Terminated) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0) if hasattr(signal, "sigtimedwait") else None
        assert info.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before


SIGNAL_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from attnscale import io
    out = Path(sys.argv[1])
    with io.staged_dir(out) as staging:
        (staging / "partial.png").write_bytes(b"x")
        print("ready", flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)])
def test_signal_mid_write_leaves_nothing(tmp_path, sig, code):
    """A real process killed by SIGTERM or SIGINT while staging: no staging folder, no output."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(io.__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_SCRIPT, str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert _names(out) == []


def test_json_safe_makes_non_finite_numbers_null_for_strict_json():
    record = {"loss": [1.5, float("nan"), float("inf")], "best": (-float("inf"), 2), "name": "x"}
    safe = io.json_safe(record)
    assert safe == {"loss": [1.5, None, None], "best": [None, 2], "name": "x"}
    assert json.loads(json.dumps(safe, allow_nan=False)) == safe
