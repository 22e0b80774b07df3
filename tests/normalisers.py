"""Float64 references for the weights and row statistics of every normaliser, written out from the
definitions (no stable tricks: float64 at test sizes), shared by the registry-wide tests."""

from __future__ import annotations

import torch


def reference_weights(z: torch.Tensor, keep: torch.Tensor, normaliser: str = "softmax",
                      sink: torch.Tensor | None = None,
                      lam: torch.Tensor | None = None) -> torch.Tensor:
    """p (..., H, Nq, Nk) of float64 logits z over the attended keys ``keep``; rows without keys
    are 0.  sink: softmax over the keys and the per-head sink b_h (H,), its column dropped;
    sigmoid: σ(z) on attended keys; differential: z = [z1 | z2] (..., 2 Nk), p1 − λ p2."""
    if normaliser == "differential":
        n = z.shape[-1] // 2
        return (reference_weights(z[..., :n], keep) - lam.double()
                * reference_weights(z[..., n:], keep))
    z = z.double()
    keep = keep.expand_as(z)
    if normaliser == "sigmoid":
        return torch.where(keep, torch.sigmoid(z), 0.0)
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
    entropy of p / Σp and ||diag(σ(1 - σ))||_F); differential (w = p1 − λ p2: the entropy of
    |w| / Σ|w| and the Frobenius norm of the Jacobian [J1, −λ J2] of w in both maps' logits)."""
    p = reference_weights(z, keep, normaliser, sink, lam)
    mass = p.sum(-1)
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

