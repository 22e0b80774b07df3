"""One fixed plot style per mechanism (attnscale.styles), and every figure drawing with it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import pytest

import attnscale.mechanisms.base as registry
from attnscale.mechanisms import MECHANISMS
from attnscale.styles import STYLES, style


def _key(s: dict) -> tuple[str, str, str]:
    return s["color"], s["linestyle"], s["marker"]


def _drawn(fig) -> dict[str, tuple[str, str, str]]:
    """label -> (colour, line style, marker) of every labelled line of ``fig``, asserting that a
    label drawn twice is drawn the same way."""
    out: dict[str, tuple[str, str, str]] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            if label.startswith("_"):      # milestone dots, reference lines
                continue
            got = (mcolors.to_hex(line.get_color()), line.get_linestyle(), line.get_marker())
            assert out.setdefault(label, got) == got, label
    return out


def _expected(name: str) -> tuple[str, str, str]:
    return _key(style(name))


def test_every_registry_mechanism_has_its_own_style():
    styles = {name: _key(style(name)) for name in MECHANISMS}
    assert len(set(styles.values())) == len(styles), styles
    assert len({c for c, _, _ in styles.values()}) == len(styles)  # the table: one colour each
    assert style("scaled")["color"] == mcolors.to_hex("tab:blue")   # the essay's colours
    assert style("unscaled")["color"] == mcolors.to_hex("tab:green")


def test_fixed_table_is_distinct_and_valid():
    assert len(set(STYLES.values())) == len(STYLES)
    for color, linestyle, marker in STYLES.values():
        assert mcolors.is_color_like(color) and linestyle in ("-", "--", "-.", ":") and marker


def test_mechanisms_added_later_get_distinct_stable_styles(monkeypatch):
    before = {name: style(name) for name in MECHANISMS}
    added = [f"new-mechanism-{i}" for i in range(12)]
    grown = dict(MECHANISMS, **{name: object for name in added})
    monkeypatch.setattr(registry, "MECHANISMS", grown)
    import attnscale.mechanisms
    monkeypatch.setattr(attnscale.mechanisms, "MECHANISMS", grown)
    styles = {name: _key(style(name)) for name in grown}
    assert len(grown) >= 20
    assert len(set(styles.values())) == len(styles), styles          # pairwise distinct
    assert {name: style(name) for name in before} == before          # nobody else moved
    assert style(added[0]) == style(added[0])                        # deterministic


def test_other_labels_avoid_the_registry_and_overrides_apply():
    taken = {_key(style(name)) for name in MECHANISMS}
    assert _key(style("qk-layernorm, no divisor")) not in taken
    assert style("scaled", linestyle=":", markevery=0.1) == {
        **style("scaled"), "linestyle": ":", "markevery": 0.1}


# ---------------------------------------------------------------------------------------------
# Every figure draws each mechanism in its style


@pytest.fixture
def captured(monkeypatch):
    """Replace ``save`` in the given modules by a recorder of the figures they would write."""
    figures: dict[str, object] = {}

    def install(*modules):
        for module in modules:
            monkeypatch.setattr(module, "save", lambda fig, path: figures.setdefault(
                Path(path).name, fig))
        return figures
    yield install
    for fig in figures.values():
        plt.close(fig)


def test_every_mechanism_at_init_figure(tmp_path, monkeypatch, captured):
    """The every-mechanism figure, where repeated colours once made two lines one, drawn at a
    tiny size."""
    import attnscale.report.sections.montecarlo as section
    monkeypatch.setattr(section, "ESSAY_D_KS", (4, 16))
    monkeypatch.setattr(section, "MECHANISM_TRIALS", 8)
    figures = captured(section)
    section.report_section_mechanisms(tmp_path, seed=0)
    drawn = _drawn(figures["figure_mechanisms_at_init.png"])
    at_init = [name for name, cls in MECHANISMS.items() if cls.defined_at_init]
    assert sorted(drawn) == sorted(at_init) and len(at_init) > 10
    assert drawn == {name: _expected(name) for name in at_init}
    assert len(set(drawn.values())) == len(drawn)


def _rows(mechanisms, stats):
    return [{"mechanism": m, "d_k": d, **{f"{s}_{k}": 0.5 for s in stats for k in ("mean", "se")}}
            for m in mechanisms for d in (4, 16, 64)]


def test_gradient_paths_figure(tmp_path, captured):
    import attnscale.report.sections.gradient as section
    figures = captured(section)
    section.plot_gradient_paths(_rows(("scaled", "unscaled"), ("routing_norm", "value_norm")),
                                tmp_path / section.FIGURE)
    assert _drawn(figures[section.FIGURE]) == {m: _expected(m) for m in ("scaled", "unscaled")}


def _run(mechanism: str, seed: int = 0):
    """The fields of a RunResult that the recall figures read."""
    smoothed = [2.0 / (1 + t) for t in range(50)]
    return SimpleNamespace(mechanism=mechanism, smoothed=smoothed, steps_to_loss_1=1,
                           steps_to_loss_0_1=19, plateaus=[{"start": 5, "end": 9, "level": 0.3}],
                           trace=[{"step": t, "entropy": 1.0, "max_weight": 0.5, "logit_std": 2.0}
                                  for t in (0, 10, 20)], config=SimpleNamespace(seed=seed))


def test_recall_loss_curves():
    from attnscale.experiments.recall.figures import plot_loss_curves
    from attnscale.report.figures import new_figure
    fig, (ax,) = new_figure()
    names = list(MECHANISMS)
    plot_loss_curves(ax, [_run(m) for m in names] + [_run("scaled", seed=1)])
    assert _drawn(fig) == {m: _expected(m) for m in names}
    faint = [line for line in ax.get_lines() if line.get_label().startswith("_") and
             line.get_alpha() == 0.35]
    assert len(faint) == 1 and mcolors.to_hex(faint[0].get_color()) == style("scaled")["color"]
    plt.close(fig)


def test_recall_section_figures(tmp_path, captured):
    import attnscale.report.sections.recall as section
    figures = captured(section)
    runs = [_run(m) for m in section.DEMO_MECHANISMS]
    section._figure_attention(tmp_path, runs)
    assert _drawn(figures["figure3b_recall_attention.png"]) == {
        m: _expected(m) for m in section.DEMO_MECHANISMS}
    sgd = {"runs": [_run("init-reparam"), _run("scaled"), _run("scaled")], "qk_lr_mult": 16.0,
           "lr": 0.1}
    section._figure_init_reparam(tmp_path, [_run("scaled"), _run("init-reparam")], sgd)
    drawn = _drawn(figures["figure3c_init_reparam.png"])
    color, _, marker = _expected("scaled")
    assert drawn["scaled"] == _expected("scaled")
    assert drawn["init-reparam"] == drawn["init-reparam, lr"] == _expected("init-reparam")
    assert drawn["scaled, 16x lr on W_Q, W_K"] == (color, "--", marker)
    assert drawn["scaled, lr"] == (color, ":", marker)
