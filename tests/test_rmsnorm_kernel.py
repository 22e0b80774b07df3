"""qk-rmsnorm's RMSNorm on the compiled kernels (attnscale.kernels.rmsnorm): values and gradients
of x and of the gain against float64 autograd, per head and over the model, in the layouts the
kernels meet (q and k as (B, H, N, d) views of a (B, N, H·d) projection, SDPA's (B, N, H, d)
gradients, expanded gradients), on every build the CPU runs.

Tolerances: y = w x ρ is a few float32 roundings of each value (relative 1e-6); dx = ρ w g -
(ρ³ Σ w g x / m) x and the gain's gradient (a float32 sum over at most 64 tokens, folded into
float64) may cancel, so they are compared with an absolute floor of 1e-5 of their scale.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from attnscale.kernels import native, rmsnorm
from attnscale.mechanisms.qk_rmsnorm import RMS_EPS
from attnscale.mechanisms.rownorm import rms_heads, rms_rows

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="attnscale's compiled kernels are not built or disabled")

ISA = pytest.mark.parametrize("portable", [False, True, native.AVX2],
                              ids=["native", "portable", "avx2"])


def reference(x: torch.Tensor, gain: torch.Tensor, g: torch.Tensor, grouped: bool):
    """(y, dx, d_gain, scale) in float64 by autograd through the formula; ``scale`` is the
    largest term dx is a difference of, max ρ |w g|: float32 rounding is relative to it."""
    xd = x.detach().double().requires_grad_()
    gd = gain.detach().double().requires_grad_()
    dims = (1, 3) if grouped else (-1,)
    rho = (xd.square().mean(dim=dims, keepdim=True) + RMS_EPS).rsqrt()
    y = xd * rho * gd
    dx, dgain = torch.autograd.grad(y, (xd, gd), g.double())
    return y, dx, dgain, (rho * (gd * g.double()).abs()).max().item()


def layouts(b: int, h: int, n: int, d: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """x (B, H, N, d) in the layouts q and k arrive in."""
    return {"contiguous": torch.randn(b, h, n, d, generator=gen),
            "projection": torch.randn(b, n, h * d, generator=gen).view(b, n, h, d).transpose(1, 2),
            "padded rows": torch.randn(b, h, n, d + 3, generator=gen)[..., :d]}


@pytest.mark.parametrize("grouped", [False, True], ids=["over head", "over model"])
@pytest.mark.parametrize("d", [1, 5, 16, 64, 67])
def test_values_and_gradients_match_float64(grouped, d):
    gen = torch.Generator().manual_seed(d)
    b, h, n = 2, 3, 37
    fn = rms_heads if grouped else rms_rows
    for name, x in layouts(b, h, n, d, gen).items():
        x = (3.0 * x).requires_grad_()
        gain = (1 + 0.3 * torch.randn((h, 1, d) if grouped else (d,), generator=gen))
        gain.requires_grad_()
        # SDPA's CPU backward hands gradients back as (B, N, H, d)
        g = torch.randn(b, n, h, d, generator=gen).transpose(1, 2)
        assert rmsnorm.usable(x, gain, grouped)
        y = fn(x, gain, RMS_EPS)
        dx, dgain = torch.autograd.grad(y, (x, gain), g)
        want_y, want_dx, want_dgain, scale = reference(x, gain, g, grouped)
        assert_close(y.double(), want_y, rtol=1e-6, atol=1e-6, msg=name)
        assert_close(dx.double(), want_dx, rtol=1e-5, atol=1e-5 * scale, msg=name)
        assert_close(dgain.double(), want_dgain, rtol=1e-5,
                     atol=1e-5 * want_dgain.abs().max().item(), msg=name)
        assert y.stride() == x.stride() or not x.is_contiguous(), name
        if name == "projection":  # outputs keep the projection's layout: no transposing copy
            assert y.stride() == x.stride() and dx.stride() == x.stride()


@pytest.mark.parametrize("grouped", [False, True], ids=["over head", "over model"])
def test_the_kernels_agree_with_the_pytorch_formulation(grouped, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 50, 24, generator=gen).requires_grad_()
    gain = (1 + 0.2 * torch.randn((4, 1, 24) if grouped else (24,), generator=gen))
    gain.requires_grad_()
    g = torch.randn(3, 4, 50, 24, generator=gen)
    fn = rms_heads if grouped else rms_rows

    def run():
        y = fn(x, gain, RMS_EPS)
        return (y, *torch.autograd.grad(y, (x, gain), g))

    compiled = run()
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    native.library.cache_clear()
    try:
        assert not rmsnorm.usable(x, gain, grouped)
        torch_path = run()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    for a, b, name in zip(compiled, torch_path, ("y", "dx", "d_gain")):
        assert_close(a, b, rtol=2e-5, atol=2e-5, msg=name)


def test_two_and_three_dimensional_rows_and_an_expanded_gradient():
    gen = torch.Generator().manual_seed(2)
    gain = torch.rand(8, generator=gen).requires_grad_()
    for shape in ((40, 8), (3, 40, 8)):
        x = torch.randn(*shape, generator=gen).requires_grad_()
        y = rms_rows(x, gain, RMS_EPS)
        dx, dgain = torch.autograd.grad(y.sum(), (x, gain))   # g: ones, expanded (stride 0)
        want_y, want_dx, want_dgain, scale = reference(x, gain, torch.ones(shape), False)
        assert_close(y.double(), want_y, rtol=1e-6, atol=1e-6)
        assert_close(dx.double(), want_dx, rtol=1e-5, atol=1e-5 * scale)
        assert_close(dgain.double(), want_dgain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True], ids=["over head", "over model"])
def test_threads_split_tokens_without_changing_values(grouped, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 700, 16, generator=gen).requires_grad_()
    gain = torch.rand((4, 1, 16) if grouped else (16,), generator=gen).requires_grad_()
    g = torch.randn(2, 4, 700, 16, generator=gen)
    fn = rms_heads if grouped else rms_rows
    out = {}
    for threads in (1, 2):
        monkeypatch.setattr(rmsnorm, "MIN_TOKENS_PER_WORKER", 100)
        with torch.inference_mode(False):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                y = fn(x, gain, RMS_EPS)
                out[threads] = (y, *torch.autograd.grad(y, (x, gain), g))
            finally:
                torch.set_num_threads(before)
    # bit for bit: the gain's float partial sums cover the same tokens whatever the split, and
    # only their float64 total's order changes
    assert torch.equal(out[1][0], out[2][0]) and torch.equal(out[1][1], out[2][1])
    assert_close(out[1][2], out[2][2], rtol=1e-12, atol=0.0)


@ISA
@pytest.mark.parametrize("grouped", [False, True], ids=["over head", "over model"])
def test_every_build_gives_the_same_rows(portable, grouped):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 9, 37, generator=gen)
    gain = torch.rand((3, 1, 37) if grouped else (37,), generator=gen)
    g = torch.randn(2, 3, 9, 37, generator=gen)
    rho = torch.empty((2, 9) if grouped else (2, 3, 9))
    y, dx = torch.empty_like(x), torch.empty_like(x)
    d_gain = torch.zeros(gain.shape, dtype=torch.float64)
    m = 3 * 37 if grouped else 37
    native.rownorm_forward(x, y, rho, gain, m=m, eps=RMS_EPS, grouped=grouped, span=(0, 18),
                           portable=portable)
    native.rownorm_backward(x, g, dx, rho, gain, d_gain, m=m, grouped=grouped, span=(0, 18),
                            portable=portable)
    want_y, want_dx, want_dgain, scale = reference(x, gain, g, grouped)
    assert_close(y.double(), want_y, rtol=1e-6, atol=1e-6)
    assert_close(dx.double(), want_dx, rtol=1e-5, atol=1e-5 * scale)
    assert_close(d_gain, want_dgain, rtol=1e-5, atol=1e-5 * want_dgain.abs().max().item())


@pytest.mark.parametrize("grouped", [False, True], ids=["over head", "over model"])
def test_nan_reaches_its_row_or_token_and_zero_rows_stay_zero(grouped):
    x = torch.randn(1, 2, 4, 8)
    x[0, 0, 1, 3] = float("nan")
    x[0, 1, 2] = 0.0
    gain = torch.ones((2, 1, 8) if grouped else (8,))
    y = (rms_heads if grouped else rms_rows)(x, gain, RMS_EPS)
    nan_rows = torch.isnan(y).all(-1)
    want = torch.zeros(1, 2, 4, dtype=torch.bool)
    want[0, 0, 1] = True
    if grouped:
        want[0, :, 1] = True      # one norm over the token's heads
    assert torch.equal(nan_rows, want) and not torch.isnan(y[~want]).any()
    assert torch.equal(y[0, 1, 2], torch.zeros(8))


def test_wrappers_refuse_bad_tensors():
    x = torch.randn(1, 2, 3, 4)
    rho = torch.empty(1, 2, 3)
    with pytest.raises(ValueError, match="x must be"):
        native.rownorm_forward(x.double(), x, rho, None, m=4, eps=1e-6, grouped=False,
                               span=(0, 3))
    with pytest.raises(ValueError, match="rho must be"):
        native.rownorm_forward(x, torch.empty_like(x), torch.empty(2, 3), None, m=4, eps=1e-6,
                               grouped=False, span=(0, 3))
    with pytest.raises(ValueError, match="span"):
        native.rownorm_forward(x, torch.empty_like(x), rho, None, m=4, eps=1e-6, grouped=False,
                               span=(0, 4))
    with pytest.raises(ValueError, match="gain must hold"):
        native.rownorm_forward(x, torch.empty_like(x), rho, torch.ones(5), m=4, eps=1e-6,
                               grouped=False, span=(0, 3))
    assert not rmsnorm.usable(x.double(), None, False)
    assert not rmsnorm.usable(x.transpose(-1, -2), None, False)   # rows not of unit stride
    assert not rmsnorm.usable(torch.randn(2, 3), None, True)       # over the model: (B, H, N, d)
