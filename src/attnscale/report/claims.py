"""Every number the essay quotes, in one table.

Each :class:`Claim` names the essay's value exactly as printed (a string, so its precision is known)
and how a measurement is judged against it.  Experiments fill in :class:`~attnscale.report.Measurement`
objects keyed by ``Claim.id``; :mod:`attnscale.report.writer` turns the pair into a report row.
An id that is not in the table is an error (:func:`check_claim_ids`), not a dropped row.

:data:`QUOTES` holds the essay's other printed numbers: those the report shows beside ours but
judges through a claim derived from them (unscaled / scaled ratios).  Every number the essay prints
is written once, in this module; sections read them with :func:`essay`.

Checks
------
``Estimate()``
    The essay's value is itself a Monte Carlo estimate at the same sample size as ours, so the two
    differ by sampling noise with standard error ``sqrt(2) * se``.  They agree when the gap is within
    1.96 of that (plus half a unit in the essay's last printed digit).
``Exact(rel)``
    A deterministic quantity; agrees within relative tolerance ``rel`` plus the printed precision.
``AtMost(bound)`` / ``Within(lo, hi)``
    The essay states a bound or a range; the measured value must satisfy it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from attnscale.errors import did_you_mean


@dataclass(frozen=True)
class Estimate:
    """Both numbers are Monte Carlo estimates with the same standard error."""


@dataclass(frozen=True)
class Exact:
    """A deterministic quantity, agreeing to relative tolerance ``rel``."""
    rel: float = 0.0


@dataclass(frozen=True)
class AtMost:
    """The essay claims the quantity is at most ``bound``."""
    bound: float


@dataclass(frozen=True)
class Within:
    """The essay claims the quantity lies in ``[lo, hi]``."""
    lo: float
    hi: float


Check = Estimate | Exact | AtMost | Within


@dataclass(frozen=True)
class Claim:
    id: str        # stable key shared by experiments, results.json and the report row
    section: str   # the essay's section heading
    quantity: str  # what is measured, in the report's words
    essay: str     # the essay's value as printed ("7.9774", "0.5%", "256-1024")
    check: Check   # how our measurement is judged against it


_VAR = "The Variance Argument"
_SAT = "What Breaks Without It"
_GRAD = "The Gradient Argument"
_SMALL = "Keep the head small"
_DEMO = "A Training Demo"
_INIT = "Move it into the initialization"
_MUP = "Use 1/d instead (muP)"
# Claims the essay does not make, from the sources they cite, are filed under the report's
# heading for such material ("Beyond the essay", as in attnscale.report.include); their ``essay``
# field holds the source's value.
_BEYOND = "Beyond the essay"

# Numbers the essay prints that the report shows beside ours (the recall section's table) but
# judges only through a claim derived from them: a ratio of two runs, a range.  Each is written
# here once, as printed; the claims below and the sections read them from this table.
QUOTES: dict[str, str] = {
    "recall.steps_to_loss_1.scaled": "224",
    "recall.steps_to_loss_1.unscaled": "424",
    "recall.steps_to_loss_0_1.scaled": "436",
    "recall.steps_to_loss_0_1.unscaled": "822",
    "recall.plateau.unscaled.steps": "~530-820",    # "between roughly steps 530 and 820"
    "recall.plateau.unscaled.level": "0.3",         # "a plateau near loss 0.3"
    "recall.final_loss.scaled": "0.00562",
    "recall.final_loss.unscaled": "0.01374",
    "recall.grad_wq.scaled": "0.1085",
    "recall.grad_wq.unscaled": "1.0610",
    "recall.sqrt_d_k": "16",                        # sqrt(256), the demo's d_k
    "recall.eval_sequences": "2000",
    "recall.eval_accuracy": "100.0%",               # "Both models reached 100.0%"
}
_Q = QUOTES
_SQRT_D_K = float(_Q["recall.sqrt_d_k"])


# The essay shows a stall in its one unscaled run.  Under a stall rate p that happens with
# probability p, so a rate below 0.05 would make the essay's run a less than 5% event (the
# level of the report's 95% intervals): the claim is a rate of at least this, judged like every
# range against our fraction's 95% Wilson interval (attnscale.stats.wilson_interval).
ONE_RUN_PLAUSIBLE = 0.05


def _ratio(key: str) -> str:
    """The essay's unscaled / scaled ratio of quote ``key``, to the 3 digits the table shows."""
    return f"{float(_Q[key + '.unscaled']) / float(_Q[key + '.scaled']):.2f}"


CLAIMS: tuple[Claim, ...] = (
    Claim("variance.std.dk64", _VAR, "std of q.k at d_k=64 (100k pairs)", "7.9774", Estimate()),
    Claim("variance.max_rel_error", _VAR, "max |rel. error| of std vs sqrt(d_k), d_k=4..1024",
          "0.5%", AtMost(0.005)),
    Claim("saturation.scaled.max_weight.dk64", _SAT, "scaled mean max weight, d_k=64", "0.0434",
          Estimate()),
    Claim("saturation.scaled.max_weight.dk1024", _SAT, "scaled mean max weight, d_k=1024",
          "0.0431", Estimate()),
    Claim("saturation.scaled.entropy.mean", _SAT, "scaled mean entropy (nats), avg over d_k",
          "5.05", Estimate()),
    Claim("saturation.unscaled.max_weight.dk4", _SAT, "unscaled mean max weight, d_k=4", "0.170",
          Estimate()),
    Claim("saturation.unscaled.max_weight.dk64", _SAT, "unscaled mean max weight, d_k=64", "0.749",
          Estimate()),
    Claim("saturation.unscaled.max_weight.dk1024", _SAT, "unscaled mean max weight, d_k=1024",
          "0.936", Estimate()),
    Claim("saturation.unscaled.entropy.dk4", _SAT, "unscaled mean entropy (nats), d_k=4", "3.97",
          Estimate()),
    Claim("saturation.unscaled.entropy.dk64", _SAT, "unscaled mean entropy (nats), d_k=64", "0.75",
          Estimate()),
    Claim("saturation.unscaled.entropy.dk1024", _SAT, "unscaled mean entropy (nats), d_k=1024",
          "0.159", Estimate()),
    Claim("saturation.uniform_entropy", _SAT, "uniform entropy ceiling ln 256 (nats)", "5.545",
          Exact()),
    Claim("jacobian.scaled.mean", _GRAD, "scaled mean ||J||_F, avg over d_k", "0.099", Estimate()),
    Claim("jacobian.unscaled.dk4", _GRAD, "unscaled mean ||J||_F, d_k=4", "0.187", Estimate()),
    Claim("jacobian.unscaled.dk16", _GRAD, "unscaled mean ||J||_F, d_k=16 (the peak)", "0.288",
          Estimate()),
    Claim("jacobian.unscaled.dk64", _GRAD, "unscaled mean ||J||_F, d_k=64", "0.231", Estimate()),
    Claim("jacobian.unscaled.dk256", _GRAD, "unscaled mean ||J||_F, d_k=256", "0.142",
          Estimate()),
    Claim("jacobian.unscaled.dk1024", _GRAD, "unscaled mean ||J||_F, d_k=1024", "0.083",
          Estimate()),
    Claim("jacobian.unscaled.peak_dk", _GRAD, "d_k at which unscaled ||J||_F peaks", "16",
          Exact()),
    Claim("jacobian.crossing_dk", _GRAD, "d_k where unscaled ||J||_F crosses below scaled",
          "256-1024", Within(256, 1024)),
    Claim("small_head.dk_threshold.n256", _SMALL, "d_k below which unscaled stays unsaturated, "
          "2 ln n at n=256", "11", Exact(rel=0.05)),
    Claim("small_head.n_threshold.dk4", _SMALL, "keys needed to saturate at d_k=4, exp(d_k/2)",
          "7", Exact(rel=0.08)),
    # --- Associative-recall training (attnscale.report.sections.recall) ---------------------------------
    # The essay's model is not fully specified (batch, d_model, smoothing), so step counts are
    # judged as ratios unscaled / scaled within [1.4, 4] (means over the section's seeds, with
    # Student's t interval); the absolute numbers (QUOTES above) stand side by side with the
    # essay's in the section's table.
    Claim("recall.steps_to_loss_1.ratio", _DEMO, "steps to smoothed loss 1.0, unscaled / scaled "
          f"(essay {_Q['recall.steps_to_loss_1.unscaled']} / {_Q['recall.steps_to_loss_1.scaled']})",
          _ratio("recall.steps_to_loss_1"), Within(1.4, 4.0)),
    Claim("recall.steps_to_loss_0_1.ratio", _DEMO, "steps to smoothed loss 0.1, unscaled / scaled "
          f"(essay {_Q['recall.steps_to_loss_0_1.unscaled']} / "
          f"{_Q['recall.steps_to_loss_0_1.scaled']})",
          _ratio("recall.steps_to_loss_0_1"), Within(1.4, 4.0)),
    # A stall is chaotic: whether a seed's unscaled run stalls changes with the float rounding
    # of the CPU.  So the claim is a rate over seeds with its binomial interval, not one run.
    Claim("recall.plateau.unscaled.fraction", _DEMO, "fraction of seeds whose unscaled run "
          "stalls above loss 0.1, detected automatically (essay: its one run stalls near "
          f"{_Q['recall.plateau.unscaled.level']} at steps {_Q['recall.plateau.unscaled.steps']})",
          "1 of 1 run", Within(ONE_RUN_PLAUSIBLE, 1.0)),
    Claim("recall.final_loss.ratio", _DEMO, "final smoothed loss, unscaled / scaled "
          f"(essay {_Q['recall.final_loss.unscaled']} / {_Q['recall.final_loss.scaled']})", "2.4",
          Within(1.4, 4.0)),
    Claim("recall.eval_accuracy.scaled", _DEMO, "held-out accuracy, scaled "
          f"({_Q['recall.eval_sequences']} sequences)", _Q["recall.eval_accuracy"],
          Within(0.995, 1.0)),
    Claim("recall.eval_accuracy.unscaled", _DEMO, "held-out accuracy, unscaled "
          f"({_Q['recall.eval_sequences']} sequences)", _Q["recall.eval_accuracy"],
          Within(0.995, 1.0)),
    Claim("recall.grad_wq.ratio", _DEMO, "||dL/dW_Q||_F at step 0, unscaled / scaled: larger, not "
          f"smaller, yet below sqrt(d_k) = {_Q['recall.sqrt_d_k']} (essay "
          f"{_Q['recall.grad_wq.unscaled']} / {_Q['recall.grad_wq.scaled']})", "9.8",
          Within(1.0, _SQRT_D_K)),
    Claim("recall.grad_wq.saturation", _DEMO, "saturation factor = that ratio / "
          "sqrt(d_k), between 1/sqrt(d_k) and 1", "0.61", Within(1.0 / _SQRT_D_K, 1.0)),
    Claim("recall.init_reparam.step0_gap", _INIT, "init-reparam vs "
          "scaled, same init and batch: relative loss gap at step 0", "0", AtMost(1e-6)),
    Claim("recall.init_reparam.sgd_tracking", _INIT, "SGD: "
          "init-reparam at lr vs scaled with sqrt(d_k) lr on W_Q, W_K, max relative loss gap",
          "0", AtMost(1e-4)),
    Claim("recall.init_reparam.adam_separation", _INIT, "Adam: first "
          "step where init-reparam's loss differs from scaled's by > 1%", "< 10,000",
          AtMost(10_000)),
    Claim("recall.logit_std.exponent_init", _MUP, "a in std(q.k) ~ d_k^a at "
          "init, d_k 16-256 (independent q, k)", "0.5", Within(0.45, 0.55)),
    Claim("recall.logit_std.exponent_trained", _MUP, "a in std(q.k) ~ d_k^a "
          "once trained (scaled runs, d_k 16-256)", "1", Within(0.75, 1.25)),

    # --- Gradient paths and init-reparam, measured by attnscale.report.sections.gradient ---------------
    Claim("gradient.routing.one_hot", _GRAD, "routing path ||J a|| at one-hot p (unscaled row, "
          "d_k=1024, logits x1e4)", "0", AtMost(1e-12)),
    Claim("gradient.value.one_hot", _GRAD, "value path ||(p_i g)_i|| / ||g|| at one-hot p: stays "
          "healthy", "1", Within(0.999, 1.001)),
    Claim("gradient.routing_share.unscaled.dk1024", _GRAD, "routing / value path norm, unscaled "
          "d_k=1024, n=256: frozen routing, learnable payload (scaled ~ 1)", "<< 1",
          AtMost(0.25)),
    Claim("init_reparam.step0.max_abs_diff", _INIT, "init-reparam vs "
          "scaled logits at step 0, same seed, float64: max |diff|", "identical", AtMost(1e-6)),
    Claim("init_reparam.sgd.max_abs_diff", _INIT, "one SGD step, lr "
          "vs lr*sqrt(d_k) on W_Q, W_K (scaled): max |logit diff|", "equivalent", AtMost(1e-6)),
    Claim("init_reparam.adam.rel_diff", _INIT, "one Adam step, same "
          "lr mapping: max |logit diff| / scaled's max logit change", "differ",
          Within(0.1, float("inf"))),

    # --- Entropy vs number of keys at init, d_k = 64 (attnscale.report.sections.keys) ----------
    # Scaled logits q.k / sqrt(d_k) are ~N(0, 1): below the condensation point sqrt(2 ln n) the
    # entropy is ln n - sigma^2 / 2 + o(1) (random energy model, Derrida 1981), so it tracks ln n.
    Claim("keys.scaled.entropy_slope", _BEYOND, "scaled: slope dH/d ln n of the mean entropy "
          "at init; 1 means the gap ln n - H stays constant, the attention disperses (random "
          "energy model, Derrida 1981)", "1", Within(0.9, 1.1)),
    # Nakanishi 2025 (SSMax, arXiv 2501.19399, Sec. 2 and Fig. 1): a key leading the rest by a
    # fixed margin gets weight ~1/n under a fixed temperature, but keeps it under s ln n.
    Claim("keys.planted.scaled.exponent", _BEYOND, "scaled: b in weight ~ n^b of one key "
          "leading the others by a fixed margin, large n (fades like 1/n; Nakanishi 2025)",
          "-1", Within(-1.1, -0.9)),
    Claim("keys.planted.ssmax.exponent", _BEYOND, "ssmax: b in planted-key weight ~ n^b, same "
          "key (does not fade under s ln n; Nakanishi 2025)", "0", Within(-0.1, 0.1)),
)

CLAIMS_BY_ID: dict[str, Claim] = {c.id: c for c in CLAIMS}
if len(CLAIMS_BY_ID) != len(CLAIMS) or set(CLAIMS_BY_ID) & set(QUOTES):  # pragma: no cover
    raise RuntimeError("duplicate id in CLAIMS or QUOTES")  # guards edits to the tables above


def check_claim_ids(ids: Iterable[str], where: str) -> None:
    """Raise ``ValueError`` naming the first id in ``ids`` that is not a claim of :data:`CLAIMS`:
    a measurement nobody can judge is a bug in ``where``, never a row to drop."""
    for claim_id in ids:
        if claim_id not in CLAIMS_BY_ID:
            raise ValueError(f"{where}: unknown claim id {claim_id!r}."
                             f"{did_you_mean(claim_id, CLAIMS_BY_ID)} Claims are listed in "
                             "attnscale.report.claims.CLAIMS.")


def essay(key: str) -> str:
    """The essay's printed text for a claim id (its ``essay``) or a :data:`QUOTES` key."""
    if key in CLAIMS_BY_ID:
        return CLAIMS_BY_ID[key].essay
    if key in QUOTES:
        return QUOTES[key]
    raise ValueError(f"unknown essay number {key!r}.{did_you_mean(key, [*CLAIMS_BY_ID, *QUOTES])}")
