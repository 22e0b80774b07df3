"""The essay's gradient argument, measured ("The Gradient Argument", "Move it into the init...").

For one query with logits z (n keys), weights p = softmax(z), values v_i and upstream gradient
g = dL/do, the output o = Σ_i p_i v_i gives two paths back:

* the value path, dL/dv_i = p_i g, which never touches the softmax Jacobian J;
* the routing path, dL/dz = J a with a_i = v_iᵀ g and J = diag(p) - p pᵀ, i.e.
  (J a)_i = p_i (a_i - Σ_j p_j a_j).  Every gradient reaching W_Q and W_K is a linear image of it,
  and it vanishes as p approaches one-hot, while the value path tends to g on the selected key.

:func:`init_reparam_checks` measures the essay's claims about moving 1/sqrt(d) into the init.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnscale.attention import MultiHeadAttention
from attnscale.errors import (
    check_choice, check_float, check_int, check_int_list, check_name_list, check_unique,
)
from attnscale.measure.montecarlo import (
    SECONDS_PER_KEY_COORDINATE, check_time, sample_chi, shortcut_rule,
)
from attnscale.memory import check_memory
from attnscale.mechanisms import MECHANISMS, build_mechanism
from attnscale.pipeline import temper
from attnscale.progress import progress
from attnscale.rng import cell_seed, rng
from attnscale.stats import max_weight, mean_se

# d_k swept by the gradient-path experiment (the essay's range) and its default size.
GRADIENT_DKS = (1, 4, 16, 64, 256, 1024)
GRADIENT_N = 256
GRADIENT_TRIALS = 1000
# Width of the values: only a_i = v_iᵀ g enters the routing path, and with g ~ N(0, I / d_v) it is
# N(0, ~1) whatever d_v is; d_v sets the spread of |g|, hence of the value path's norm.
GRADIENT_DV = 64
# Logit multipliers that drive p from diffuse to one-hot: 1/32 = 1/sqrt(1024) is the scaled
# temperature at the default d_k, 1 the unscaled row, and at 1e4 every non-top weight underflows
# to exactly 0.
ONE_HOT_MULTIPLIERS = (1 / 32, 1 / 8, 1 / 2, 1.0, 4.0, 16.0, 64.0, 256.0, 1e4)


@dataclass(frozen=True)
class GradientPaths:
    """The two ways dL/do flows back through one softmax row."""
    weights: Tensor  # p, (..., n)
    value: Tensor    # dL/dv_i = p_i g, (..., n, d_v)
    routing: Tensor  # dL/dz = J a, (..., n)


def gradient_paths(z: Tensor, v: Tensor, g: Tensor) -> GradientPaths:
    """Split attention's backward pass into its value and routing paths.

    ``z`` is (..., n) logits, ``v`` (..., n, d_v) values, ``g`` (..., d_v) the gradient of the loss
    with respect to the output.  J a is computed as p ∘ (a - pᵀa) in O(n) per row, without J.
    """
    p = torch.softmax(z, dim=-1)                               # (..., n)
    a = (v @ g.unsqueeze(-1)).squeeze(-1)                      # a_i = v_iᵀ g, (..., n)
    value = p.unsqueeze(-1) * g.unsqueeze(-2)                  # p_i g, (..., n, d_v)
    return GradientPaths(weights=p, value=value, routing=_routing(p, a))


def _routing(p: Tensor, a: Tensor) -> Tensor:
    """The routing path J a = p ∘ (a - pᵀa) of weights p and a_i = v_iᵀ g, both (..., n)."""
    return p * (a - (p * a).sum(-1, keepdim=True))


def _path_norms(z: Tensor, v: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of logits ``z``: max weight (:func:`attnscale.stats.max_weight`), ||J a||_2 and the
    Frobenius norm of the value path over all keys."""
    paths = gradient_paths(z, v, g)
    return max_weight(z), paths.routing.norm(dim=-1), paths.value.flatten(-2).norm(dim=-1)


def gradient_path_sweep(d_ks: Sequence[int] = GRADIENT_DKS,
                        mechanisms: Sequence[str] = ("scaled", "unscaled"), *,
                        n: int = GRADIENT_N, trials: int = GRADIENT_TRIALS, seed: int = 0,
                        chunk: int = 100, show_progress: bool | None = None) -> list[dict]:
    """Mean routing and value path norms vs d_k, one row per (mechanism, d_k).

    Row keys: ``max_weight``, ``routing_norm`` (||J a||_2) and ``value_norm`` (||(p_i g)_i||_F),
    each as ``<key>_mean`` and ``<key>_se`` (standard error over trials).

    Each trial is one query q and n keys with i.i.d. N(0, 1) coordinates in d_k dimensions, n
    values in ``GRADIENT_DV`` dimensions and g ~ N(0, I / d_v), so a_i = v_iᵀ g has unit variance
    and the paths are comparable across d_k.  Norms are per query row; ``*_se`` are standard errors.

    Sampled exactly in distribution with n + 1 normals per trial where the essay's method draws
    (n + 1) d_k + n d_v (:mod:`attnscale.measure.montecarlo`'s chi-square shortcut): given q, the
    raw logits q.k_i are i.i.d. N(0, |q|^2), so they are |q| h_i with |q| ~ chi(d_k), which
    serves every mechanism whose logits are a function of q.k alone (the others get q and k
    sampled coordinatewise); given g, the a_i are i.i.d. N(0, |g|^2), and the value path's norm
    is |g| ||p||_2, so only |g| ~ chi(d_v) / sqrt(d_v) and a_i = |g| h'_i are drawn.  The
    mechanisms of a trial share its samples.
    """
    d_ks = check_int_list("d_ks", d_ks, minimum=1)
    n = check_int("n", n, minimum=1)
    trials = check_int("trials", trials, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    chunk = check_int("chunk", chunk, minimum=1)
    mechanisms = check_name_list("mechanisms", [mechanisms] if isinstance(mechanisms, str)
                                 else mechanisms)
    for name in mechanisms:
        check_choice("mechanisms", name, tuple(MECHANISMS), what="mechanism")
    # Which mechanisms take the shortcut is a property of their rule, not of d_k.
    direct = any(shortcut_rule(build_mechanism(name, 2, 1), n) is None for name in mechanisms)
    for d_k in d_ks:  # q and k of one chunk where a mechanism needs them, float32, and their
        # copies; the shortcut's logits, the a_i and the paths of one chunk; three float32
        # norms per trial and mechanism kept until the row is summarised
        check_memory(f"trials={trials} of n={n} keys at d_k={d_k} in chunks of {chunk}",
                     16 * min(chunk, trials) * n * (d_k * direct + 4)
                     + 12 * trials * len(mechanisms))
    check_time(f"trials={trials}", trials * n * (sum(d_ks) * direct + len(d_ks))
               * SECONDS_PER_KEY_COORDINATE)
    bar = progress(None, desc="gradient paths", total=len(d_ks) * trials, enabled=show_progress)
    with contextlib.closing(bar):
        return [row for d_k in d_ks
                for row in _gradient_rows(d_k, mechanisms, n, trials, seed, chunk, bar.update)]


def _gradient_rows(d_k: int, mechanisms: list[str], n: int, trials: int, seed: int, chunk: int,
                   advance) -> list[dict]:
    """Rows of :func:`gradient_path_sweep` for one ``d_k``; ``advance(k)`` reports progress."""
    gen = rng(seed, "gradient-paths", d_k)
    mechs = {name: build_mechanism(name, d_k, 1) for name in mechanisms}  # at init
    rules = {name: shortcut_rule(mech, n) for name, mech in mechs.items()}
    stats: dict[str, list[list[Tensor]]] = {name: [[], [], []] for name in mechs}
    for start in range(0, trials, chunk):
        t = min(chunk, trials - start)
        if any(rule is not None for rule in rules.values()):
            norm_q = sample_chi(d_k, (t, 1), gen).float()             # |q|, (T, 1)
            raw = torch.randn(t, n, generator=gen).mul_(norm_q)       # q.k_i, (T, n)
        if any(rule is None for rule in rules.values()):
            q = torch.randn(t, 1, 1, d_k, generator=gen)              # (T, 1, 1, d)
            k = torch.randn(t, 1, n, d_k, generator=gen)              # (T, 1, n, d)
        g_norm = sample_chi(GRADIENT_DV, (t, 1), gen).float() / math.sqrt(GRADIENT_DV)  # |g|
        a = torch.randn(t, n, generator=gen).mul_(g_norm)             # a_i = v_iᵀ g, (T, n)
        for name, mech in mechs.items():
            rule = rules[name]
            if rule is not None:
                z = temper(raw, rule.scale, rule.cap, rule.offset)    # (T, n)
            else:
                with torch.no_grad():
                    z = mech.logits(q, k)[:, 0, 0]                    # (T, n)
            p = torch.softmax(z, dim=-1)
            for acc, x in zip(stats[name], (max_weight(z), _routing(p, a).norm(dim=-1),
                                             p.norm(dim=-1) * g_norm[:, 0])):
                acc.append(x)
        advance(t)
    rows = []
    for name, (mw, routing, value) in stats.items():
        row = {"mechanism": name, "d_k": d_k, "n": n, "trials": trials}
        for key, parts in (("max_weight", mw), ("routing_norm", routing),
                           ("value_norm", value)):
            row[f"{key}_mean"], row[f"{key}_se"] = mean_se(torch.cat(parts))
        rows.append(row)
    return rows


def one_hot_limit(d_k: int = 1024, *, n: int = GRADIENT_N,
                  multipliers: Sequence[float] = ONE_HOT_MULTIPLIERS, seed: int = 0) -> list[dict]:
    """Routing and value path of one unscaled row as its logits are multiplied towards one-hot.

    float64; ``value_over_g`` is the value-path norm divided by ||g||, which tends to 1.
    """
    d_k = check_int("d_k", d_k, minimum=1)
    n = check_int("n", n, minimum=1)
    multipliers = check_unique("multipliers", [check_float("multipliers", m, positive=True)
                                               for m in multipliers])
    check_memory(f"n={n} keys at d_k={d_k}", 8 * 4 * n * d_k)
    gen = rng(seed, "one-hot-limit")
    q = torch.randn(d_k, generator=gen, dtype=torch.float64)
    k = torch.randn(n, d_k, generator=gen, dtype=torch.float64)
    v = torch.randn(n, d_k, generator=gen, dtype=torch.float64)
    g = torch.randn(d_k, generator=gen, dtype=torch.float64) / math.sqrt(d_k)
    z = build_mechanism("unscaled", d_k, 1).logits(q.view(1, 1, 1, d_k), k.view(1, 1, n, d_k))
    rows = []
    for m in multipliers:
        max_w, routing, value = _path_norms(m * z.view(n), v, g)
        rows.append({"mechanism": "unscaled", "d_k": d_k, "n": n, "multiplier": m,
                     "max_weight": max_w.item(), "routing_norm": routing.item(),
                     "value_norm": value.item(), "value_over_g": (value / g.norm()).item()})
    return rows


def _twin_models(d_model: int, n_heads: int, seed: int) -> tuple[MultiHeadAttention, ...]:
    """``scaled`` and ``init-reparam`` attention built from the same seed, in float64."""
    models = []
    for mechanism in ("scaled", "init-reparam"):
        # The same draws for W_Q, W_K, W_V, W_O in both; the module draws from torch's global
        # generator, so it is seeded inside fork_rng and the caller's state is left untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cell_seed(seed, "init-reparam-weights"))
            models.append(MultiHeadAttention(d_model, n_heads, mechanism, dtype=torch.float64))
    return tuple(models)


def _one_step(model: MultiHeadAttention, opt_name: str, lr: float, qk_lr: float,
              x: Tensor, y: Tensor) -> None:
    """One optimiser step on ½ ||model(x) - y||² with learning rate ``qk_lr`` on W_Q and W_K."""
    qk = [model.w_q.weight, model.w_k.weight]
    rest = [p for p in model.parameters() if all(p is not w for w in qk)]
    opt_cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.Adam
    opt = opt_cls([{"params": qk, "lr": qk_lr}, {"params": rest, "lr": lr}])
    opt.zero_grad()
    (0.5 * (model(x) - y).pow(2).sum()).backward()
    opt.step()


def init_reparam_checks(d_model: int = 64, n_heads: int = 1, *, n_tokens: int = 16,
                        batch: int = 4, lr: float = 1e-3, seed: int = 0) -> list[dict]:
    """Measure the essay's three claims about init-reparam against scaled, in float64.

    Rows (``check`` names them), each with ``max_abs_diff`` of the attention logits:

    * ``step0``: logits of the two models built from the same seed;
    * ``sgd``: after one SGD step, init-reparam at ``lr`` vs scaled at ``lr·√d_k`` on W_Q and W_K;
    * ``adam``: the same mapping under Adam; ``rel_diff`` divides by scaled's own logit change;
    * ``adam-quarter``: Adam is invariant to the gradient's scale, so under Adam init-reparam at
      ``lr`` tracks scaled at ``lr·d_k^(1/4)`` instead (equal up to Adam's eps).
    """
    d_model = check_int("d_model", d_model, minimum=1)
    lr = check_float("lr", lr, positive=True)
    gen = rng(seed, "init-reparam-data")
    x = torch.randn(batch, n_tokens, d_model, generator=gen, dtype=torch.float64)
    y = torch.randn(batch, n_tokens, d_model, generator=gen, dtype=torch.float64)
    scaled, reparam = _twin_models(d_model, n_heads, seed)
    d_k = scaled.d_head
    with torch.no_grad():
        z0 = scaled.logits(x)
        rows = [{"check": "step0", "d_k": d_k,
                 "max_abs_diff": (reparam.logits(x) - z0).abs().max().item()}]
    for check, opt_name, qk_factor in (("sgd", "sgd", math.sqrt(d_k)),
                                       ("adam", "adam", math.sqrt(d_k)),
                                       ("adam-quarter", "adam", d_k ** 0.25)):
        scaled, reparam = _twin_models(d_model, n_heads, seed)
        _one_step(scaled, opt_name, lr, lr * qk_factor, x, y)
        _one_step(reparam, opt_name, lr, lr, x, y)
        with torch.no_grad():
            z_scaled, z_reparam = scaled.logits(x), reparam.logits(x)
        diff = (z_reparam - z_scaled).abs().max().item()
        change = (z_scaled - z0).abs().max().item()
        rows.append({"check": check, "d_k": d_k, "optimizer": opt_name, "lr": lr,
                     "scaled_qk_lr": lr * qk_factor, "max_abs_diff": diff,
                     "logit_change": change, "rel_diff": diff / change})
    return rows
