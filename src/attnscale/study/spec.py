"""What a study is: data.  A :class:`Study` names its sweep stores (an experiment, a grid and
fixed settings each), a quick variant, the options a user may change, and one analysis function
from the stores' records to an :class:`Analysis` (tables, claims, figures, markdown).  The one
launcher (:mod:`attnscale.study.launcher`) runs, resumes and redraws every study from this."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A grid axis: its values, or a function giving them when the study runs (every registered
# mechanism, read when the study starts rather than when its module is imported).
Values = Sequence[Any] | Callable[[], Sequence[Any]]


@dataclass(frozen=True)
class Trials:
    """One sweep store of a study: ``experiment``'s trials over ``grid``, on ``fixed``."""
    experiment: str                       # a name in attnscale.experiments.registry
    grid: Mapping[str, Values]            # axis -> values; their product is the trials
    fixed: Mapping[str, Any] = field(default_factory=dict)   # other settings (else defaults)
    # Where the store lives in the study folder: "" the folder itself, else that subfolder.
    # None: the folder itself for a study of one store, else a subfolder named by its key.
    folder: str | None = None
    # A store that extends the study's default grid (a wider model on fewer seeds, say): run
    # only when no grid axis is given, since a grid of the user's own choosing is that grid.
    default_only: bool = False

    def resolved(self) -> tuple[dict[str, list], dict[str, Any]]:
        """The grid (callables called) and the fixed settings, as plain dicts."""
        grid = {k: list(v() if callable(v) else v) for k, v in self.grid.items()}
        return grid, dict(self.fixed)


@dataclass(frozen=True)
class Option:
    """A study's own command-line option: a comma-separated list of values for a grid axis, or
    one value for a fixed setting, of every store whose grid or fixed settings name ``key``.

    Its text is read by the experiment's parameter type (``--steps 1e3`` as an int is refused
    as the engine refuses it), each value checked by ``check`` (which may return its canonical
    form), and a repeated value is an error."""
    flag: str                             # "--lrs"
    key: str                              # the experiment parameter it sets: "lr"
    help: str
    axis: bool = True                     # a grid axis (a list) or a fixed setting (one value)
    aliases: tuple[str, ...] = ()         # other spellings of the flag: ("--dk",)
    minimum: float | None = None          # every value must be >= this
    check: Callable[[Any], Any] | None = None
    every: Callable[[], Sequence[Any]] | None = None   # what the value "all" stands for
    choices: Sequence[str] | None = None  # allowed values (argparse lists them in --help)
    metavar: str | None = None
    default_text: str | None = None       # the default in --help, when not the store's values


@dataclass(frozen=True)
class Analysis:
    """What a study draws from its records; :func:`attnscale.study.fragment.write_fragment`
    writes it into the study folder."""
    markdown: str                         # fragment.md (headings of level 4 and deeper)
    claims: Sequence[dict]                # fragment.json's claim rows (report/include's contract)
    tables: Mapping[str, Any]             # the study's JSON file: every table and claim
    figures: Mapping[str, Callable[[], Any]]   # PNG file name -> draws the figure
    table: Sequence[dict] = ()            # the rows printed on the terminal
    columns: Sequence[str] = ()           # ... and their columns
    printed: Mapping[str, Any] = field(default_factory=dict)   # extra keys of --json


@dataclass(frozen=True)
class Study:
    """A study: its stores, its quick variant, its options and its analysis.

    With one store the study folder is that store (``sweep.json``, ``results.jsonl``); with
    several, each is a subfolder named by its key.  ``analyse`` gets ``{key: ok records}`` (a
    store with no finished run gives ``[]``) and returns the :class:`Analysis`; ``files`` are the
    names it may write (the summary JSON and every figure), checked before any work.
    """
    name: str                             # `attnscale study NAME`
    title: str                            # fragment.json's title: the heading in the report
    doc: str                              # one paragraph: what the study measures
    stores: Mapping[str, Trials]
    analyse: Callable[[Mapping[str, list[dict]]], Analysis]
    summary: str                          # the JSON file of every table and claim
    figures: Sequence[str]                # every PNG the analysis may draw
    quick: Mapping[str, Trials] | None = None   # --quick: these stores instead
    # The figures the results page (attnscale results) shows, each with its caption, in order.
    page_figures: Mapping[str, str] = field(default_factory=dict)
    quick_doc: str = ""                   # what --quick runs, in words
    options: Sequence[Option] = ()
    examples: str = ""                    # extra worked examples for --help

    def trials(self, quick: bool = False) -> Mapping[str, Trials]:
        """The stores of the full study, or of its quick variant."""
        if quick and self.quick is None:
            from attnscale.errors import ConfigError
            raise ConfigError(f"the {self.name} study has no --quick variant.")
        return self.quick if quick else self.stores
