"""The prepared GPU run (benchmarks/gpu.py) end to end on the CPU at its small sizes, so that it is
known to work before a GPU is ever available: every registry mechanism is a row that passes, a
failing check is a row with its error while the others go on, and the JSON on disk holds every
row finished so far."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from attnscale.errors import ConfigError
from attnscale.mechanisms import MECHANISMS

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One run of every section on the CPU; (exit code, JSON on disk, printed table)."""
    out = tmp_path_factory.mktemp("gpu") / "run.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        import io
        from contextlib import redirect_stdout
        printed = io.StringIO()
        with redirect_stdout(printed):
            code = gpu.main(["--device", "cpu", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return code, json.loads(out.read_text()), printed.getvalue()


def _rows(data, section):
    return [r for r in data["rows"] if r["section"] == section]


def test_every_section_runs_and_passes_on_the_cpu(cpu_run):
    code, data, printed = cpu_run
    bad = [(r["section"], r["case"], r["dtype"], r["result"]) for r in data["rows"]
           if r["check"] != "ok"]
    assert bad == [] and code == 0
    assert data["meta"]["rows_done"] == len(data["rows"])
    assert data["meta"]["checks"] == {"ok": len(data["rows"])}
    assert data["meta"]["instruction_set"] and data["meta"]["sdpa_kernel"]["float32"]
    # One table: a header, then one line per row.
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("section"))
    assert len([line for line in lines[header + 1:] if line.split()[0] in gpu.SECTIONS]) \
        == len(data["rows"])


def test_values_cover_every_registry_mechanism_in_both_dtypes(cpu_run):
    _, data, _ = cpu_run
    rows = _rows(data, "values")
    assert [(r["case"], r["dtype"]) for r in rows] == [
        (name, dtype) for name in MECHANISMS for dtype in ("bfloat16", "float32")]
    for r in rows:
        tol = gpu.VALUES_TOL[getattr(torch, r["dtype"])]
        assert 0 <= r["out_err"] <= tol["out"] and 0 <= r["grad_err"] <= tol["grad"], r
        assert "x" in r["grad_errs"] and len(r["grad_errs"]) >= 5   # x and W_Q, W_K, W_V, W_O


def test_flex_rows_are_the_mechanisms_that_declare_a_cap_or_a_logit_bias(cpu_run):
    _, data, _ = cpu_run
    rows = _rows(data, "flex")
    declared = gpu.flex_mechanisms()
    assert "softcap" in declared
    assert "scaled" not in declared and "sigmoid" not in declared
    assert rows[0]["mechanisms"] == declared
    assert [(r["case"], r["dtype"]) for r in rows[1:]] == [
        (name, dtype) for name in declared for dtype in ("bfloat16", "float32")]
    for r in rows[1:]:
        assert r["out_err"] <= r["tol"] and r["grad_err"] <= r["tol"]
        assert r["fused_over_sdpa"] > 0 and r["sdpa_kernel"] in ("flash", "math", "efficient")
        assert r["path"] == "CPU kernels" and r["top_kernels"]


def test_a_declared_logit_bias_joins_the_flex_section(monkeypatch):
    """A mechanism is picked up by what it declares, not by a list in the script."""
    cls = MECHANISMS["scaled"]
    monkeypatch.setattr(cls, "logit_bias", "test", raising=False)
    assert "scaled" in gpu.flex_mechanisms()


def test_lm_and_monitor_rows(cpu_run):
    _, data, _ = cpu_run
    lm = {r["case"]: r for r in _rows(data, "lm")}
    assert list(lm) == ["setup", "plain", "guard", "guard+qk-clip"]
    assert lm["plain"]["over_plain"] == 1.0
    for variant in ("plain", "guard", "guard+qk-clip"):
        assert lm[variant]["steps_per_s"] > 0
    monitor, = _rows(data, "monitor")
    assert monitor["records"] == 16 and monitor["over_plain"] > 0     # 4 layers x 4 heads


def test_a_failing_check_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    real = gpu.check_values

    def failing(name, dtype, device, sizes):
        if name == "softcap" and dtype == torch.bfloat16:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(name, dtype, device, sizes)

    monkeypatch.setattr(gpu, "check_values", failing)
    monkeypatch.setattr(gpu, "monitor_section", _raise_import_error)
    out = tmp_path / "run.json"
    code = gpu.main(["--device", "cpu", "--out", str(out), "--sections", "values,monitor"])
    data = json.loads(out.read_text())
    assert code == 1
    failed = [r for r in data["rows"] if r["check"] == "error"]
    assert [(r["case"], r["dtype"]) for r in failed] == [("softcap", "bfloat16"),
                                                          ("llama N=64", "float32")]
    assert failed[0]["result"].startswith("RuntimeError: CUDA error")
    assert "Traceback" in failed[0]["traceback"]
    assert sum(r["check"] == "ok" for r in data["rows"]) == 2 * len(MECHANISMS) - 1
    assert "error" in capsys.readouterr().out


def _raise_import_error(run, device, sizes):
    def missing():
        raise ModuleNotFoundError("No module named 'transformers'")
    run.row("monitor", f"llama N={sizes.monitor_n}", torch.float32, missing)


def test_the_json_on_disk_holds_every_finished_row(tmp_path):
    """Written atomically after each row: what a killed run leaves is every row it finished."""
    out = tmp_path / "run.json"
    run = gpu.Run(str(out), {"device": "cpu"}, budget=60.0)
    assert json.loads(out.read_text())["rows"] == []
    for i in range(3):
        run.row("values", f"case{i}", torch.float32, lambda: {"check": "ok", "result": "r"})
        data = json.loads(out.read_text())
        assert [r["case"] for r in data["rows"]] == [f"case{j}" for j in range(i + 1)]
        assert data["meta"]["rows_done"] == i + 1
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []


def test_rows_past_the_budget_are_skipped(tmp_path):
    run = gpu.Run(str(tmp_path / "run.json"), {}, budget=-1.0)
    row = run.row("lm", "plain", None, lambda: pytest.fail("ran past the budget"))
    assert row["check"] == "skipped"


def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys):
    foreign = tmp_path / "theirs.json"
    foreign.write_text("{}")
    for argv in (["--device", "cpu", "--out", str(foreign)],
                 ["--device", "cpu", "--out", str(tmp_path / "x.json"), "--sections", "lm,lm"],
                 ["--device", "cpu", "--out", str(tmp_path / "x.json"), "--sections", "gpu"]):
        with pytest.raises((SystemExit, ConfigError)):
            gpu.main(argv)
    assert foreign.read_text() == "{}"
    assert not (tmp_path / "x.json").exists()
