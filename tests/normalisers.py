"""Float64 references for the weights and row statistics of every normaliser, written out from the
definitions (no stable tricks: float64 at test sizes), shared by the registry-wide tests."""

from __future__ import annotations

import torch

# Softpick's ε (Zuhri et al. 2025), written here again: the reference states the definition.
SOFTPICK_EPS = 1e-8


def _row_weights(z: torch.Tensor, keep: torch.Tensor, normaliser: str) -> torch.Tensor:
    """Softpick and stick-breaking weights of float64 z over the keys ``keep`` (same shape),
    from the definitions: ReLU(e^z - 1) / (Σ|e^z - 1| + ε), and β_j Π_{k>j} (1 - β_k) with a
    plain cumulative product (no log space)."""
    z = torch.where(keep, z, 0.0)             # masked keys take no part (and no NaN gradient)
    if normaliser == "softpick":
        a = torch.where(keep, torch.relu(torch.expm1(z)), 0.0)
        return a / (torch.where(keep, torch.expm1(z).abs(), 0.0).sum(-1, keepdim=True)
                    + SOFTPICK_EPS)
    beta = torch.where(keep, torch.sigmoid(z), 0.0)
    left = (1 - beta).flip(-1).cumprod(-1).flip(-1)          # Π_{k >= j} (1 - β_k)
    after = torch.cat([left[..., 1:], torch.ones_like(left[..., :1])], -1)
    return beta * after


def _jacobian_fro(z: torch.Tensor, keep: torch.Tensor, normaliser: str) -> torch.Tensor:
    """||∂p/∂z||_F of each row of the softpick or stick-breaking weights, by autograd over the
    reference weights (..., n) -> (...)."""
    n = z.shape[-1]
    flat_z, flat_keep = z.reshape(-1, n), keep.reshape(-1, n)
    jac = torch.func.vmap(torch.func.jacrev(lambda zr, kr: _row_weights(zr, kr, normaliser)))(
        flat_z, flat_keep)                                    # (rows, n, n)
    return jac.pow(2).sum((-2, -1)).sqrt().reshape(z.shape[:-1])


def reference_weights(z: torch.Tensor, keep: torch.Tensor, normaliser: str = "softmax",
                      sink: torch.Tensor | None = None,
                      lam: torch.Tensor | None = None) -> torch.Tensor:
    """p (..., H, Nq, Nk) of float64 logits z over the attended keys ``keep``; rows without keys
    are 0.  sink: softmax over the keys and the per-head sink b_h (H,), its column dropped;
    sigmoid: σ(z) on attended keys; softpick and stick-breaking: :func:`_row_weights`;
    differential: z = [z1 | z2] (..., 2 Nk), p1 − λ p2."""
    if normaliser == "differential":
        n = z.shape[-1] // 2
        return (reference_weights(z[..., :n], keep) - lam.double()
                * reference_weights(z[..., n:], keep))
    z = z.double()
    keep = keep.expand_as(z)
    if normaliser == "sigmoid":
        return torch.where(keep, torch.sigmoid(z), 0.0)
    if normaliser in ("softpick", "stick-breaking"):
        return _row_weights(z, keep, normaliser)
    e = torch.where(keep, torch.exp(z), 0.0)
    denom = e.sum(-1, keepdim=True)
    if normaliser == "sink":
        return e / (denom + torch.exp(sink.double()).view(-1, 1, 1))
    return torch.where(denom > 0, e / torch.where(denom > 0, denom, 1.0), 0.0)


def reference_distribution_stats(z: torch.Tensor, keep: torch.Tensor, normaliser: str = "softmax",
                                 sink: torch.Tensor | None = None,
                                 lam: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """max_weight, entropy, jacobian_fro and mass per row, as attnscale.stats defines them for
    each normaliser: softmax; sink (the distribution over the keys and the sink); sigmoid (the
    entropy of p / Σp and ||diag(σ(1 - σ))||_F); softpick and stick-breaking (the entropy of
    p / Σp and the Frobenius norm of the map's Jacobian, by autograd); differential (w = p1 −
    λ p2: the entropy of |w| / Σ|w| and the Frobenius norm of the Jacobian [J1, −λ J2] of w in
    both maps' logits)."""
    p = reference_weights(z, keep, normaliser, sink, lam)
    mass = p.sum(-1)
    if normaliser in ("softpick", "stick-breaking"):  # rows need not sum to 1, nor hold weight
        q = p / torch.where(mass > 0, mass, 1.0).unsqueeze(-1)
        jac = _jacobian_fro(z.double(), keep.expand_as(z), normaliser)
        empty = ~keep.expand_as(z).any(-1)
        out = {"max_weight": p.amax(-1), "entropy": torch.special.entr(q).sum(-1),
               "jacobian_fro": jac, "mass": mass}
        return {key: torch.where(empty, 0.0, v) for key, v in out.items()}
    if normaliser == "differential":
        n = z.shape[-1] // 2
        jacs = []
        for half in (z[..., :n], z[..., n:]):
            pi = reference_weights(half, keep)
            jacs.append(torch.diag_embed(pi) - pi.unsqueeze(-1) * pi.unsqueeze(-2))
        jac = torch.cat([jacs[0], -lam.double() * jacs[1]], -1)              # (..., n, 2n)
        a = p.abs()
        share = a / torch.where(a.sum(-1) > 0, a.sum(-1), 1.0).unsqueeze(-1)
        empty = ~keep.expand(*z.shape[:-1], n).any(-1)
        out = {"max_weight": p.amax(-1), "entropy": torch.special.entr(share).sum(-1),
               "jacobian_fro": jac.pow(2).sum((-2, -1)).sqrt(), "mass": mass}
        return {key: torch.where(empty, 0.0, v) for key, v in out.items()}
    if normaliser == "sigmoid":
        q = p / torch.where(mass > 0, mass, 1.0).unsqueeze(-1)
        jac = torch.sqrt((p * (1 - p)).pow(2).sum(-1))
        return {"max_weight": p.amax(-1), "entropy": torch.special.entr(q).sum(-1),
                "jacobian_fro": jac, "mass": mass}
    full = p if normaliser == "softmax" else torch.cat([p, (1 - mass).unsqueeze(-1)], -1)
    jac = torch.diag_embed(full) - full.unsqueeze(-1) * full.unsqueeze(-2)
    empty = ~keep.expand_as(z).any(-1)
    out = {"max_weight": full.amax(-1), "entropy": torch.special.entr(full).sum(-1),
           "jacobian_fro": jac.pow(2).sum((-2, -1)).sqrt(), "mass": mass}
    return {key: torch.where(empty, 0.0, v) for key, v in out.items()}


def sink_of(mechanism) -> torch.Tensor | None:
    """The mechanism's sink logits (H,) for the sink normaliser, else None."""
    return mechanism.sink_logits().detach() if mechanism.normaliser == "sink" else None


def lam_of(mechanism) -> torch.Tensor | None:
    """λ of the differential normaliser (0-d), else None."""
    return mechanism.lam().detach() if mechanism.normaliser == "differential" else None

