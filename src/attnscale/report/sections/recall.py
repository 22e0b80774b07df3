"""Report section for the essay's training demo: Figure 3 and every training number, measured.

Runs, as trials of the ``recall`` experiment on the sweep engine (the recall study's engine,
:func:`attnscale.study.launcher.run_trials`): scaled and unscaled at the default settings for
:data:`SECTION_SEEDS` seeds (:data:`FULL_SEEDS` under ``attnscale reproduce --full``);
init-reparam under Adam for :data:`REPARAM_STEPS` steps on the same seeds; the init-reparam SGD
runs for :data:`SGD_STEPS` steps; scaled at the smaller d_k of :data:`SCALING_D_KS` for the
logit-scaling exponent (on the first seed; on every seed under ``--full``).  The demo's store
trains on one worker, the others one after another on a second, beside it.  Quantities the
unspecified architecture sets (absolute step counts, losses, gradient norms) are shown next to
the essay's in a table; verdicts are on ratios and bounds (see the recall block of
:mod:`attnscale.report.claims`).

Training is chaotic: the same seed follows a different trajectory on a CPU that rounds its
float32 sums differently (another instruction set), so whether one seed's unscaled run stalls is
not a property of the code.  Every claim that depends on a trajectory is therefore a statistic
over the seeds with its 95% interval: a mean with Student's t interval, the stall a fraction
with its Wilson interval (:func:`attnscale.stats.wilson_interval`).
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from attnscale.experiments.recall import RecallConfig
from attnscale.experiments.recall import metrics
from attnscale.io import json_safe
from attnscale.experiments.recall.experiments import (
    adam_separation, grad_decomposition, logit_scaling, milestone_ratios, sgd_configs,
    sgd_tracking,
)
from attnscale.experiments.recall.figures import MARKEVERY, plot_loss_curves
from attnscale.experiments.recall.trainer import RunResult, config_dict
from attnscale.plotting import new_figure, save
from attnscale.report import Measurement, Section
from attnscale.report.claims import essay
from attnscale.report.parallel import beside
from attnscale.stats import mean_se, t975, wilson_interval
from attnscale.study.seeds import finite, spread
from attnscale.study.spec import Trials
from attnscale.styles import style
from attnscale.workers import start_fork_server

# Seeds seed, seed+1, ... of the demo.  The default is what fits `attnscale reproduce`'s goal of
# 30 s on an idle 2-core machine (benchmarks/bench_reproduce.py); --full runs enough for the stall
# rate's interval to be about +/-0.15 wide (Wilson, at the ~1/3 of seeds that stall).
SECTION_SEEDS = 3
FULL_SEEDS = 32
# Init-reparam under Adam parts from scaled within ~10 steps and reaches loss 0.1 by ~230
# (seeds 0-2), so its runs stop here; scaled's first REPARAM_STEPS steps are the demo's own.
REPARAM_STEPS = 300
SGD_STEPS = 300                # the SGD pair reaches loss 0.1 by ~200 steps at SGD_LR
SCALING_D_KS = (16, 64, 256)   # d_k grid of the exponent fit (1024 lives in `study recall`)
# The exponent is far from chaotic: seeds 0-2 give 0.374, 0.376, 0.383 once trained (AVX2), 70
# standard deviations below the claim's range, so the default fits it on the first seed alone
# (its d_k = 16 and 64 runs cost a quarter of the section); --full fits it on every seed.
DEMO_MECHANISMS = ("scaled", "unscaled", "init-reparam")


def _over_seeds(values: list[float | None], fmt: str = "{:.3g}") -> Measurement | None:
    """Mean over seeds with the standard error of the mean, Student's t 95% interval (the
    standard error is itself estimated from the few seeds) and the per-seed values in the note;
    None (no measurement) when no seed has a value, e.g. a milestone no run reached."""
    got = finite(values)
    shown = (_spread(values, fmt) if len(values) > LISTED_SEEDS
             else ", ".join("never" if v is None else fmt.format(v) for v in values))
    if not got:
        return None
    mean, se = mean_se(torch.tensor(got))
    if len(got) < 2:
        return Measurement(mean, note=f"seeds: {shown}")
    half = t975(len(got) - 1) * se
    return Measurement(mean, se=se, ci95=(mean - half, mean + half), note=f"seeds: {shown}")


def _stall_fraction(unscaled: list[RunResult], scaled: list[RunResult]) -> Measurement:
    """The fraction of seeds whose unscaled run stalls above the last milestone, with its Wilson
    interval; the note names each stall and says how many scaled runs stall."""
    stalls = {r.config.seed: _stalls(r) for r in unscaled}
    k, n = sum(map(bool, stalls.values())), len(stalls)
    where = "; ".join(f"seed {s}: {p['level']:.3g} at steps {p['start']}-{p['end']}"
                      for s, ps in stalls.items() for p in ps)
    scaled_k = sum(bool(_stalls(r)) for r in scaled)
    note = (f"{k} of {n} seeds" + (f": {where}" if where else "")
            + f"; scaled: {scaled_k} of {len(scaled)}")
    return Measurement(k / n, ci95=wilson_interval(k, n), note=note)


def _mid_plateaus(run: RunResult) -> list[dict]:
    """Plateaus after the start: the initial stall (start = 0) is the run finding its feet."""
    return [p for p in run.plateaus if p["start"] > 0]


def _stalls(run: RunResult) -> list[dict]:
    """The essay's kind of plateau: mid-training, above the last milestone (loss 0.1), i.e. a
    stall on the way to solving the task rather than a bump in its convergence tail."""
    return [p for p in _mid_plateaus(run) if p["level"] > metrics.MILESTONES[-1]]


def _plateau_text(run: RunResult) -> str:
    ps = _mid_plateaus(run)
    return "; ".join(f"{p['level']:.3g} at {p['start']}-{p['end']}" for p in ps) or "none"


# Seeds listed one by one in the report; more (--full) are summarised by their range.
LISTED_SEEDS = 8


def _spread(values: list[float | None], fmt: str) -> str:
    """'a, b, c (mean m ± s)' with 'never' for None; 'lo to hi (mean m ± s, n seeds)' beyond
    :data:`LISTED_SEEDS` values."""
    s = spread(values)
    if len(values) <= LISTED_SEEDS:
        text = ", ".join("never" if v is None else fmt.format(v) for v in values)
        if s["n"] > 1:
            text += f" (mean {fmt.format(s['mean'])} ± {fmt.format(s['std'])})"
        return text
    text = f"{fmt.format(s['min'])} to {fmt.format(s['max'])}" if s["n"] else "none"
    if s["n"] > 1:
        text += f" (mean {fmt.format(s['mean'])} ± {fmt.format(s['std'])}, {s['n']} seeds)"
    return text + (f"; never in {s['missing']}" if s["missing"] else "")


def _seed_text(seeds: list[int]) -> str:
    """'0, 1, 2', or '0-31' beyond :data:`LISTED_SEEDS` (the seeds are consecutive)."""
    return (", ".join(map(str, seeds)) if len(seeds) <= LISTED_SEEDS
            else f"{seeds[0]}-{seeds[-1]}")


def _plateau_cell(runs: list[RunResult]) -> str:
    """Each seed's plateaus; beyond :data:`LISTED_SEEDS` seeds, only the seeds with one."""
    shown = [r for r in runs if len(runs) <= LISTED_SEEDS or _mid_plateaus(r)]
    text = "; ".join(f"seed {r.config.seed}: {_plateau_text(r)}" for r in shown)
    if len(runs) > LISTED_SEEDS:
        text = (text + f"; none in the other {len(runs) - len(shown)} seeds" if shown
                else f"none in {len(runs)} seeds")
    return text


def _table(demo: dict, grads: list[dict], adam: list[dict], sgd: dict, scaling: list[dict],
           seeds: list[int]) -> str:
    """Markdown: every training number of the essay next to ours, per seed (the essay's column
    read from :mod:`attnscale.report.claims`)."""
    sc, un = demo["scaled"], demo["unscaled"]
    i, f3, f4, f5, pct = "{:.0f}", "{:.3g}", "{:.4g}", "{:.5f}", "{:.2%}"

    def row(what: str, key: str | None, values: list, fmt: str) -> str:
        """One table row; ``key`` names the essay's number in the claims table (None: none)."""
        return f"| {what} | {'—' if key is None else essay(key)} | {_spread(values, fmt)} |"

    def pair(what: str, field: str, fmt: str) -> list[str]:
        """Rows for scaled and unscaled of run field ``field`` (essay keys recall.<field>.<m>)."""
        return [row(f"{what}, {m}", f"recall.{field}.{m}", [getattr(r, field) for r in demo[m]],
                    fmt) for m in ("scaled", "unscaled")]

    lines = [f"Seeds {_seed_text(seeds)}; identical init and data for every mechanism "
             f"of a seed. Smoothed loss = EMA with decay {metrics.EMA_DECAY}. Step counts, losses "
             "and gradient norms depend on choices the essay does not state (batch size, d_model, "
             "smoothing), so the verdicts above judge ratios; the absolute values are here.", "",
             "| quantity | essay | ours, per seed (mean ± std) |", "|---|---|---|",
             *pair("steps to smoothed loss 1.0", "steps_to_loss_1", i),
             *pair("steps to smoothed loss 0.1", "steps_to_loss_0_1", i),
             f"| unscaled plateaus (level at steps) | ~{essay('recall.plateau.unscaled.level')} at "
             f"{essay('recall.plateau.unscaled.steps')} | "
             f"{_plateau_cell(un)} |",
             f"| scaled plateaus | none | {_plateau_cell(sc)} |",
             *pair("final smoothed loss", "final_loss", f5),
             *pair("held-out accuracy", "eval_accuracy", pct),
             row("‖∇W_Q‖_F at step 0, scaled", "recall.grad_wq.scaled",
                 [g["grad_wq_scaled"] for g in grads], f4),
             row("‖∇W_Q‖_F at step 0, unscaled", "recall.grad_wq.unscaled",
                 [g["grad_wq_unscaled"] for g in grads], f4),
             row("ratio unscaled / scaled", "recall.grad_wq.ratio", [g["ratio"] for g in grads], f3),
             f"| = sqrt(d_k) × saturation factor: saturation | {essay('recall.sqrt_d_k')} × "
             f"{essay('recall.grad_wq.saturation')} | "
             f"{_spread([g['saturation'] for g in grads], f3)} |",
             row("‖dL/dz‖ ratio at step 0 (saturation read at the logits)", None,
                 [g["logit_grad_ratio"] for g in grads], f3),
             row("mean ‖J‖_F ratio at step 0 (softmax Jacobian)", None,
                 [g["jacobian_ratio"] for g in grads], f3),
             row("final attention entropy (nats), scaled", None,
                 [r.eval_stats["entropy"] for r in sc], f3),
             row("final attention entropy (nats), unscaled", None,
                 [r.eval_stats["entropy"] for r in un], f3),
             row("final max attention weight, unscaled", None,
                 [r.eval_stats["max_weight"] for r in un], f4),
             row("init-reparam, Adam: loss gap at step 0", "init_reparam.step0.max_abs_diff",
                 [a["step0_rel_gap"] for a in adam], f3),
             row("init-reparam, Adam: first step with > 1% loss gap",
                 "recall.init_reparam.adam_separation", [a["separation_step"] for a in adam], i),
             row(f"init-reparam, Adam ({REPARAM_STEPS} steps): steps to loss 0.1 (scaled: "
                 "above)", None, [a["reparam_steps_to_loss_0_1"] for a in adam], i),
             f"| init-reparam, SGD lr {sgd['lr']:g} vs scaled with {sgd['qk_lr_mult']:g} × lr on "
             f"W_Q, W_K: max relative loss gap over {SGD_STEPS} steps | "
             f"{essay('init_reparam.sgd.max_abs_diff')} | "
             f"{sgd['tracking_max_rel_gap']:.3g} (seed {sgd['seed']}) |",
             f"| init-reparam vs plain scaled, SGD: first step with > 1% gap | — | "
             f"{sgd['plain_separation_step']} |"]
    for j, d_k in enumerate(SCALING_D_KS):
        mean = {k: spread([sc_["rows"][j][k] for sc_ in scaling])["mean"]
                for k in ("qk_std_init", "qk_std_trained", "logit_std_trained")}
        over = "means over seeds" if len(scaling) > 1 else f"seed {seeds[0]}"
        lines.append(f"| std(q.k) at d_k={d_k}: init → trained (scaled); trained logit std, "
                     f"{over} | √d_k → ~d_k | {mean['qk_std_init']:.3g} → "
                     f"{mean['qk_std_trained']:.3g}; {mean['logit_std_trained']:.3g} |")
    lines.append(f"| exponent a in std(q.k) ~ d_k^a: init → trained | "
                 f"{essay('recall.logit_std.exponent_init')} → "
                 f"{essay('recall.logit_std.exponent_trained')} | "
                 f"{_spread([sc_['exponent_init'] for sc_ in scaling], '{:.3f}')} → "
                 f"{_spread([sc_['exponent_trained'] for sc_ in scaling], '{:.3f}')} |")
    lines += ["", "The recall loss pins the *post-temperature* logit scale that confident retrieval "
              "needs (trained logit std ≈ 3 at every d_k), so behind the 1/sqrt(d_k) divisor the "
              "raw q.k grows no faster than sqrt(d_k): this task, trained to convergence in ~10^3 "
              "steps, does not show the law-of-large-numbers growth (a = 1) that the muP argument "
              "predicts once q and k align.", "",
              "Every registered mechanism on this task at d_k = 16-1024 over 3 seeds is too long for "
              "this report; `attnscale study recall --out DIR` writes its table, figure and a "
              "markdown fragment into DIR."]
    return "\n".join(lines)


def _figure_attention(fig_dir: Path, runs: list[RunResult]) -> str:
    """Entropy, max weight and logit std of the attention over training, first seed."""
    fig, axes = new_figure(3, width=4.2, height=3.4)
    stats = (("entropy", "attention entropy (nats)"), ("max_weight", "max attention weight"),
             ("logit_std", "logit std over keys (after temperature)"))
    for ax, (key, label) in zip(axes, stats):
        for r in runs:
            ax.plot([t["step"] for t in r.trace], [t[key] for t in r.trace], label=r.mechanism,
                    ms=4, **style(r.mechanism, markevery=MARKEVERY))
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.25)
    axes[2].set_yscale("log")
    axes[0].legend()
    save(fig, fig_dir / "figure3b_recall_attention.png")
    return "figure3b_recall_attention.png"


def _figure_init_reparam(fig_dir: Path, adam_runs: list[RunResult], sgd: dict) -> str:
    """Left: Adam, init-reparam vs scaled. Right: SGD, the tracking pair and plain scaled."""
    fig, (ax1, ax2) = new_figure(2, width=5.0, height=3.6)
    plot_loss_curves(ax1, adam_runs, mark_milestones=False)
    ax1.set_title("Adam, lr 3e-4: same init, same data", fontsize=9)
    reparam, boosted, plain = sgd["runs"]
    # The two scaled runs share scaled's style, told apart by their line style.
    for r, label, dash in ((reparam, "init-reparam, lr", None),
                           (boosted, f"scaled, {sgd['qk_lr_mult']:g}x lr on W_Q, W_K", "--"),
                           (plain, "scaled, lr", ":")):
        dashed = {} if dash is None else {"linestyle": dash}
        ax2.plot(r.smoothed, label=label, **style(r.mechanism, markevery=MARKEVERY, ms=4, **dashed))
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_title(f"SGD, lr {sgd['lr']:g}", fontsize=9)
    ax2.grid(True, which="both", alpha=0.25)
    ax2.legend(fontsize=8)
    save(fig, fig_dir / "figure3c_init_reparam.png")
    return "figure3c_init_reparam.png"


def _on_engine(store: Path, grid: dict, fixed: dict, *, workers: int = 1) -> list[RunResult]:
    """The runs of ``grid`` on ``fixed`` as ``recall`` trials on the sweep engine, in grid order
    (a run that fails is an error: the report's numbers need every run), on ``workers`` worker
    processes: one by default, since the report runs the section's other stores and its Monte
    Carlo sections beside it (:mod:`attnscale.report.parallel`)."""
    from attnscale.experiments.recall.trial import run_result
    from attnscale.study.launcher import run_trials
    records = run_trials(Trials("recall", grid, fixed), store, workers=workers)
    return [run_result(r) for r in records]


def _first_steps(run: RunResult, steps: int) -> RunResult:
    """``run`` over its first ``steps`` steps (curves and the plateaus that end by then)."""
    return replace(run, loss=run.loss[:steps], smoothed=run.smoothed[:steps],
                   plateaus=[p for p in run.plateaus if p["end"] < steps])


def report_section(fig_dir: Path, *, seed: int, full: bool = False) -> Section:
    """Figure 3, the training numbers over seeds, init-reparam and the logit-scaling exponent;
    ``full`` trains :data:`FULL_SEEDS` seeds instead of :data:`SECTION_SEEDS`."""
    base = RecallConfig(seed=seed)
    seeds = [seed + i for i in range(FULL_SEEDS if full else SECTION_SEEDS)]
    reparam, boosted, plain = sgd_configs(replace(base, steps=SGD_STEPS))
    fitted = seeds if full else seeds[:1]   # the seeds of the logit-scaling fit
    # --full trains for minutes, long after the Monte Carlo sections beside this one are done:
    # its many seeds train in chunks (attnscale.sweep.batch) on two workers.
    many = 2 if full else 1
    with tempfile.TemporaryDirectory(prefix="attnscale-recall-") as tmp:
        stores = Path(tmp)
        sgd_fixed = {"optimizer": "sgd", "lr": reparam.lr, "steps": SGD_STEPS, "seed": seed}
        # Every store but the demo's trains on a thread beside it, one store after another:
        # the demo (the longest, one batched model) keeps a core to itself, and the others
        # share the other core with the Monte Carlo sections (attnscale.report.parallel).
        rest = [
            partial(_on_engine, stores / "init-reparam", {"seed": seeds},
                    {"mechanism": "init-reparam", "steps": REPARAM_STEPS}, workers=many),
            partial(_on_engine, stores / "sgd",
                    {"mechanism": [reparam.mechanism, plain.mechanism]}, sgd_fixed),
            partial(_on_engine, stores / "sgd-boosted", {"qk_lr_mult": [boosted.qk_lr_mult]},
                    {**sgd_fixed, "mechanism": boosted.mechanism}),
            # each d_k's runs train as one model
            partial(_on_engine, stores / "scaling",
                    {"d_k": [d for d in SCALING_D_KS if d != base.d_k], "seed": fitted}, {},
                    workers=many)]
        start_fork_server()   # from this thread (SIGINT blocked), for both threads' workers
        with beside(rest) as others:
            runs = _on_engine(stores / "demo",
                              {"seed": seeds, "mechanism": ["scaled", "unscaled"]}, {},
                              workers=many)
        reparam_runs, sgd_pair, (sgd_boosted,), small = others.results()
    sgd = sgd_tracking(sgd_pair[0], sgd_boosted, sgd_pair[1])
    demo = {m: [r for r in runs if r.mechanism == m] for m in ("scaled", "unscaled")}
    demo["init-reparam"] = reparam_runs
    pairs = list(zip(demo["scaled"], demo["unscaled"]))
    grads = [grad_decomposition(s, u) for s, u in pairs]
    ratios = [milestone_ratios(s, u) for s, u in pairs]
    adam = [adam_separation(s, r) for s, r in zip(demo["scaled"], demo["init-reparam"])]
    trained = {(r.config.d_k, r.config.seed): r for r in [*small, *demo["scaled"]]}
    scaling = [logit_scaling(SCALING_D_KS, replace(base, seed=s),
                             trained=[trained[d, s] for d in SCALING_D_KS]) for s in fitted]

    separations = [a["separation_step"] for a in adam]  # None: never apart within the run
    m = {
        "recall.steps_to_loss_1.ratio": _over_seeds([r["steps_to_loss_1_ratio"] for r in ratios]),
        "recall.steps_to_loss_0_1.ratio": _over_seeds(
            [r["steps_to_loss_0_1_ratio"] for r in ratios]),
        "recall.plateau.unscaled.fraction": _stall_fraction(demo["unscaled"], demo["scaled"]),
        "recall.final_loss.ratio": _over_seeds([r["final_loss_ratio"] for r in ratios]),
        "recall.eval_accuracy.scaled": _over_seeds([r.eval_accuracy for r in demo["scaled"]],
                                                   "{:.4f}"),
        "recall.eval_accuracy.unscaled": _over_seeds([r.eval_accuracy for r in demo["unscaled"]],
                                                     "{:.4f}"),
        "recall.grad_wq.ratio": _over_seeds([g["ratio"] for g in grads]),
        "recall.grad_wq.saturation": _over_seeds([g["saturation"] for g in grads]),
        "recall.init_reparam.step0_gap": Measurement(max(a["step0_rel_gap"] for a in adam),
                                                     note=f"max over {len(seeds)} seeds"),
        "recall.init_reparam.sgd_tracking": Measurement(
            sgd["tracking_max_rel_gap"], note=f"{SGD_STEPS} SGD steps, lr {sgd['lr']:g}"),
        "recall.init_reparam.adam_separation": None if None in separations else Measurement(
            max(separations), note=f"latest of {len(seeds)} seeds"
            + ("" if len(seeds) > LISTED_SEEDS else ": " + ", ".join(map(str, separations)))),
        "recall.logit_std.exponent_init": _over_seeds([s_["exponent_init"] for s_ in scaling]),
        "recall.logit_std.exponent_trained": _over_seeds(
            [s_["exponent_trained"] for s_ in scaling]),
    }

    fig, (ax,) = new_figure(width=6.5, height=4.2)
    plot_loss_curves(ax, [*demo["scaled"], *demo["unscaled"]])
    ax.set_title(f"d_k={base.d_k}, batch {base.batch_size}, Adam lr {base.lr:g}; seed {seed} "
                 f"bold, seeds {seeds[1]}-{seeds[-1]} faint", fontsize=9)
    save(fig, fig_dir / "figure3_recall_loss.png")
    adam_pair = [_first_steps(demo["scaled"][0], REPARAM_STEPS), demo["init-reparam"][0]]
    figures = [("figure3_recall_loss.png",
                "Figure 3: smoothed training loss, scaled (blue) vs unscaled (green), identical "
                "init and data per seed; dots mark loss 1.0 and 0.1, bands the detected plateaus."),
               (_figure_attention(fig_dir, [demo[m][0] for m in DEMO_MECHANISMS]),
                "Attention entropy, max weight and logit std on the training batches, first seed "
                f"(init-reparam's run: {REPARAM_STEPS} steps)."),
               (_figure_init_reparam(fig_dir, adam_pair, sgd),
                "init-reparam: identical to scaled at step 0; Adam separates them, SGD with "
                "sqrt(d_k) x lr on W_Q, W_K does not.")]
    rows = ([{"kind": "run", **r.row()} for r in [*runs, *reparam_runs, *small]]
            + [{"kind": "grad_decomposition", **g} for g in grads]
            + [{"kind": "milestone_ratios", **r} for r in ratios]
            + [{"kind": "adam_separation", **a} for a in adam]
            + [{"kind": "sgd_tracking", **{k: v for k, v in sgd.items() if k != "runs"}}]
            + [{"kind": "logit_scaling", "seed": s, **r}
               for s, sc_ in zip(fitted, scaling) for r in sc_["rows"]]
            + [{"kind": "config", **config_dict(base)}])
    m = {claim: value for claim, value in m.items() if value is not None}
    return Section("A Training Demo (associative recall)", json_safe(rows), m, figures,
                   _table(demo, grads, adam, sgd, scaling, seeds))
