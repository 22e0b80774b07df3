"""The report's sections side by side (:mod:`attnscale.report.parallel`): same report, in order,
the driver running the last section, errors raised and workers stopped."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnscale.errors import ConfigError
from attnscale.report import Section
from attnscale.report.parallel import run_sections
from attnscale.report.reproduce import reproduce
from attnscale.report.sections import montecarlo
from attnscale.workers import process_context


def _where(fig_dir: Path, *, name: str, seed: int = 0, full: bool = False) -> Section:
    """A section that says which process ran it and leaves a file in the figure folder."""
    (fig_dir / f"{name}.txt").write_text(name, encoding="utf-8")
    return Section(name=name, rows=[{"pid": os.getpid()}], measurements={}, figures=[],
                   markdown=f"Section {name}.")


def _fails(fig_dir: Path) -> Section:
    raise ValueError("section failed on purpose")


@pytest.fixture
def warm_fork_server():
    """The fork server has imported attnscale: a worker starts in milliseconds, so the driver
    goes straight to the last section."""
    process = process_context().Process(target=os.getpid)
    process.start()
    process.join()


def test_sections_come_back_in_order_with_the_last_run_by_the_driver(tmp_path, warm_fork_server):
    fns = [functools.partial(_where, name=n) for n in ("a", "b", "c")]
    sections = run_sections(fns, tmp_path, workers=2)
    assert [s.name for s in sections] == ["a", "b", "c"]
    pids = [s.rows[0]["pid"] for s in sections]
    assert pids[-1] == os.getpid()          # the driver takes from the end
    assert pids[0] != os.getpid()           # a worker from the front
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "c.txt"]


def test_one_worker_runs_everything_here(tmp_path):
    fns = [functools.partial(_where, name=n) for n in ("a", "b")]
    assert {s.rows[0]["pid"] for s in run_sections(fns, tmp_path, workers=1)} == {os.getpid()}


def test_a_section_that_cannot_be_pickled_runs_in_the_driver(tmp_path):
    def local(fig_dir: Path, name: str = "local") -> Section:
        return _where(fig_dir, name=name)

    sections = run_sections([local, functools.partial(local, name="other")], tmp_path, workers=2)
    assert [s.rows[0]["pid"] for s in sections] == [os.getpid(), os.getpid()]


SLOW_SECTIONS = """
import functools, os, sys, time
from pathlib import Path
from attnscale.report import Section
from attnscale.report.parallel import run_sections

def where(fig_dir, name):
    time.sleep(0.2)
    return Section(name=name, rows=[{"pid": os.getpid()}], measurements={}, figures=[],
                   markdown="")

if __name__ == "__main__":
    sections = run_sections([functools.partial(where, name=n) for n in "abc"],
                            Path(sys.argv[1]), workers=2)
    print(" ".join("driver" if s.rows[0]["pid"] == os.getpid() else "worker"
                   for s in sections))
"""


def test_while_its_workers_start_the_driver_runs_sections_from_the_front(tmp_path):
    """A fresh process: its fork server imports attnscale for seconds, and the driver does not
    wait for it."""
    script = tmp_path / "sections.py"
    script.write_text(SLOW_SECTIONS, encoding="utf-8")
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out[0] == "driver" and out[-1] == "driver", out


def test_an_error_in_a_worker_is_raised(tmp_path, warm_fork_server):
    with pytest.raises(ValueError, match="on purpose"):
        run_sections([_fails, functools.partial(_where, name="b")], tmp_path, workers=2)


def test_workers_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="workers"):
        run_sections([functools.partial(_where, name="a")], tmp_path, workers=0)


def test_a_report_built_on_two_processes_is_the_same_bytes(tmp_path, warm_fork_server):
    # A real Monte Carlo section runs in the worker (one torch thread), the other in the driver.
    sections = (montecarlo.report_section, functools.partial(_where, name="driver"))
    serial = reproduce(tmp_path / "serial", 0, sections=sections, workers=1)
    parallel = reproduce(tmp_path / "parallel", 0, sections=sections, workers=2)
    md = [(tmp_path / d / "report.md").read_bytes() for d in ("serial", "parallel")]
    assert md[0] == md[1]
    for name in ("figure1_saturation.png", "figure2_jacobian.png"):
        assert (tmp_path / "parallel" / name).is_file()
    mc = "Monte Carlo: variance, saturation and the softmax Jacobian"
    assert serial["sections"][mc] == parallel["sections"][mc]
    assert serial["claims"] == parallel["claims"]


def test_jobs_beside_the_block_run_in_order_on_another_thread():
    import threading

    from attnscale.report.parallel import beside

    main = threading.get_ident()
    jobs = [lambda: ("a", threading.get_ident()), lambda: ("b", threading.get_ident())]
    with beside(jobs) as run:
        here = "block"
    results = run.results()
    assert here == "block"
    assert [name for name, _ in results] == ["a", "b"]
    assert all(ident != main for _, ident in results)


def test_an_error_beside_the_block_is_raised_by_results():
    from attnscale.report.parallel import beside

    with beside([lambda: 1 / 0]) as run:
        pass
    with pytest.raises(ZeroDivisionError):
        run.results()


def test_an_error_in_the_block_starts_no_further_job():
    import threading

    from attnscale.report.parallel import beside

    started, release = [], threading.Event()

    def job(name):
        def run():
            started.append(name)
            release.wait(5)
            return name
        return run

    with pytest.raises(RuntimeError, match="block failed"):
        with beside([job("first"), job("second")]):
            while not started:       # the first job is running
                threading.Event().wait(0.01)
            threading.Timer(0.2, release.set).start()   # it ends after the error
            raise RuntimeError("block failed")
    assert started == ["first"]
