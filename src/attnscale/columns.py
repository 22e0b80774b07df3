"""The names of attnscale's attention statistics, defined once.

Two tables, and everything else derives from them:

* :data:`ROW_STATS_COLUMNS`, the per-row statistics of :func:`attnscale.stats.row_stats`, in the
  order of its last dimension (the compiled kernel writes them in this order: enum ``OUT_*`` in
  ``_native/kernels.c``);
* :data:`MONITOR_SUMMARIES`, how the monitor reduces each over the query rows it sees, per head
  (a mean, a min or a max), under the key its records, tables and TensorBoard scalars use, and
  whether the monitor's and the guard's records carry it.

Derived: :data:`MEAN_STATS` (the statistics the Monte Carlo saturation and the recall
evaluation average over rows), :data:`RECORD_STATS` (the monitor's record keys),
:data:`GUARD_STATS` (the statistics of :func:`attnscale.guard`'s records).
:data:`WEIGHT_COLUMNS` are per-row quantities of other normalisers and of an output gate that the
monitor summarises beside the row statistics.

Adding a statistic: give it a formula in :func:`attnscale.stats.row_stats` (its PyTorch path builds
its columns by these names, so a name without a formula fails at the first call; a row kernel
column also needs the C enum), add its name to :data:`ROW_STATS_COLUMNS` and, to have the monitor
keep it, one :class:`Summary` line.  The monitor's per-head sums, its records, the guard's records
and log, the saturation rows and the recall evaluation then carry it.  Renaming one is the same
single edit here; a module that names a statistic itself takes it through :func:`named`, which
fails at import on a name these tables do not have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The per-row statistics, in row_stats' column order (the compiled kernel's order too).
ROW_STATS_COLUMNS = ("count", "max_weight", "entropy", "jacobian_fro", "logit_std", "logit_absmax",
                     "logit_max")
# count: unmasked keys of the row; max_weight: max_i p_i; entropy: H(p) in nats; jacobian_fro:
# ||diag(p) - p p^T||_F; logit_std: std of the unmasked logits; logit_absmax: max |z| and
# logit_max: max z (QK-Clip's S_max), both over unmasked keys.

# Per-row quantities of the weights beside row_stats' columns (not in the compiled kernel's
# output, so not in ROW_STATS_COLUMNS): mass, Σ_i p_i over the keys (attnscale.stats.row_mass: 1
# under softmax, less with a sink, anything in [0, n] under sigmoid); sink_mass, the weight left
# on a sink (0 without one); gate, the output gate's mean over the row's coordinates (1 without
# a gate).
WEIGHT_COLUMNS = ("mass", "sink_mass", "gate")
# Their value on a row of plain softmax attention without a gate.
WEIGHT_DEFAULTS = {"mass": 1.0, "sink_mass": 0.0, "gate": 1.0}

REDUCTIONS = ("mean", "min", "max")


@dataclass(frozen=True)
class Summary:
    """One per-head statistic of the monitor: row statistic ``column`` reduced over the rows by
    ``reduce`` (``"mean"``, ``"min"`` or ``"max"``), reported as ``key``."""
    key: str                 # the record key
    column: str              # a ROW_STATS_COLUMNS name
    reduce: str              # "mean" (kept as a sum), "min" or "max" (kept as the extreme)
    recorded: bool = True    # written to records and TensorBoard (else kept per head only)
    guarded: bool = True     # in the guard's records and log (attnscale.guard)
    empty: float | None = None  # value before any row (default: the reduction's identity)

    @property
    def field(self) -> str:
        """The name of the monitor's running total: ``<column>_sum`` for a mean, else ``key``."""
        return f"{self.column}_sum" if self.reduce == "mean" else self.key

    @property
    def start(self) -> float:
        """The running total before any row."""
        if self.empty is not None:
            return self.empty
        return {"mean": 0.0, "min": math.inf, "max": -math.inf}[self.reduce]


# What the monitor keeps per head, in its records' key order.
MONITOR_SUMMARIES = (
    Summary("entropy_mean", "entropy", "mean"),
    Summary("entropy_min", "entropy", "min"),
    Summary("max_weight_mean", "max_weight", "mean"),
    Summary("logit_std", "logit_std", "mean"),
    Summary("logit_absmax", "logit_absmax", "max", empty=0.0),   # |z| >= 0
    Summary("jacobian_fro_mean", "jacobian_fro", "mean"),
    # The signed peak logit, QK-Clip's S_max: the guard's max-logit alarm, not a monitor record.
    Summary("logit_max", "logit_max", "max", recorded=False),
    # What a normaliser other than softmax and an output gate do to the weights: the monitor
    # reports them; the guard, watching a training run's logits, leaves them out.
    Summary("mass_mean", "mass", "mean", guarded=False),
    Summary("sink_mass_mean", "sink_mass", "mean", guarded=False),
    Summary("gate_mean", "gate", "mean", guarded=False),
)

for _s in MONITOR_SUMMARIES:
    if _s.column not in ROW_STATS_COLUMNS + WEIGHT_COLUMNS or _s.reduce not in REDUCTIONS:
        raise ValueError(f"monitor summary {_s} names an unknown column or reduction")
if len({s.key for s in MONITOR_SUMMARIES}) != len(MONITOR_SUMMARIES):
    raise ValueError("two monitor summaries share a key")

# The monitor's record statistics (after layer, head, module and queries).
RECORD_STATS = tuple(s.key for s in MONITOR_SUMMARIES if s.recorded)
# The guard's record statistics (after step, layer, head, module, queries and n_keys).
GUARD_STATS = tuple(s.key for s in MONITOR_SUMMARIES if s.guarded)
# Row statistics that experiments average over rows (those the monitor averages), column order.
MEAN_STATS = tuple(c for c in ROW_STATS_COLUMNS
                   if any(s.column == c and s.reduce == "mean" for s in MONITOR_SUMMARIES))


def named(*names: str) -> tuple[str, ...]:
    """``names``, each checked to be a row statistic or a monitor key (a ValueError, at import of
    the module that asks, for a name that was renamed or never existed)."""
    known = set(ROW_STATS_COLUMNS) | set(WEIGHT_COLUMNS) | {s.key for s in MONITOR_SUMMARIES}
    for name in names:
        if name not in known:
            raise ValueError(f"{name!r} is not a statistic of attnscale.columns")
    return names
