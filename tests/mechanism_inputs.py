"""Inputs and gradients shared by the tests of single mechanisms against their float64 formulas
(tests/test_forgetting.py, test_selective.py, test_differential.py)."""

from __future__ import annotations

import torch

B, H, D = 2, 3, 8


def qkv(n_q: int, n_k: int, dtype=torch.float64, seed: int = 0) -> list[torch.Tensor]:
    """q (B, H, Nq, D), k and v (B, H, Nk, D), seeded, requiring gradients."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, D, generator=gen, dtype=dtype) for n in (n_q, n_k))
    v = torch.randn(B, H, n_k, D, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def random_mask(n_q: int, n_k: int, heads: int = 1) -> torch.Tensor:
    """A boolean (B, heads, Nq, Nk) mask with about 70% of keys kept, batch 0's query 1 keeping
    none (an all-masked row)."""
    mask = torch.rand(B, heads, n_q, n_k, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[0, :, 1] = False
    return mask


def grads(out: torch.Tensor, wrt, seed: int = 1):
    """∂(g · out)/∂wrt for a seeded random g of out's shape."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, wrt, g)


def assert_lower_precision(got: torch.Tensor, args, want: torch.Tensor, wrt, dtype, tol: float):
    """``got``, computed in ``dtype`` from ``args``, against the float64 ``want`` computed from
    ``wrt``: dtype kept, values within ``tol``, gradients within 10 ``tol``."""
    from torch.testing import assert_close
    assert got.dtype == dtype
    assert_close(got.double(), want, rtol=0, atol=tol)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, args, g.to(dtype)), torch.autograd.grad(want, wrt, g)):
        assert a.dtype == dtype
        assert_close(a.double(), b, rtol=0, atol=10 * tol)


def observed_rows(call) -> torch.Tensor:
    """The row statistics the pipeline hands an observer that asks for them during ``call()``:
    a mechanism with a logit bias of its own offers them and describes its bias."""
    from attnscale.attention import observe
    seen = []

    def observer(obs):
        assert obs.offers_rows and obs.mechanism_bias is not None and obs.bias is None
        obs.request_rows(seen.append)

    with observe(observer):
        call()
    (rows,) = seen
    return rows


def nan_rows(run, where: str, n: int = 6) -> list[bool]:
    """Which output rows of (batch 0, head 0) are NaN when q, k or v (``where``; ``"none"``:
    neither) holds a NaN at position 2 of that head: ``run(q, k, v)`` -> (B, H, n, D), float64
    inputs."""
    q, k, v = (t.detach() for t in qkv(n, n))
    if where != "none":
        {"q": q, "k": k, "v": v}[where][0, 0, 2, 0] = float("nan")
    return run(q, k, v)[0, 0].isnan().any(-1).tolist()
