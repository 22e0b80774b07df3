"""The blockwise softmax kernel that forms the logits once for a call's output and its row
statistics (attnscale.kernels.softmax_rows), and the monitor's use of it under torch.no_grad().

The row statistics come out of the same C code as attnscale.kernels.rowstats (one row pass, which
also writes the weights), so they are compared with it bit for bit; the weights and the output
against float64 formulas written here.  The monitor's records with the swap must equal those of
``exact_outputs=True`` (SDPA, and q kᵀ scored beside it) to float32 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from attnscale import pipeline
from attnscale.attention import MultiHeadAttention
from attnscale.errors import ConfigError
from attnscale.kernels import native, rowstats, softmax_rows
from attnscale.measure.monitor import SCALAR_KEYS, blocks, monitor
from attnscale.stats import row_stats
from attnscale.workers import num_threads

ISA = pytest.mark.parametrize("portable", [False, True, native.AVX2],
                              ids=["native", "portable", "avx2"])


def _logits(rows: int, n: int, seed: int) -> torch.Tensor:
    """Random rows with masked keys, and one of each special kind: a NaN, no key, one key, a top
    far above the rest (the kernel's second pass near one-hot), a tie at the top."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, n, generator=g) * 3
    z[torch.rand(rows, n, generator=g) < 0.2] = -math.inf
    z[0, n // 2] = math.nan
    z[1] = -math.inf
    z[2] = -math.inf
    z[2, n - 1] = 0.5
    z[3, 0] = z[3].max() + 60.0
    z[4, :2] = z[4].max() + 1.0
    return z


def _softmax64(z: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float64 softmax over each row's first ``keys`` columns; rows without a key all 0."""
    zd = z.double().masked_fill(torch.arange(z.shape[-1]) >= keys[:, None], -math.inf)
    p = torch.softmax(zd, dim=-1)
    return torch.where(torch.isneginf(zd).all(-1, keepdim=True), 0.0, p)


@ISA
@pytest.mark.parametrize("n", [3, 17, 513, 1030])
@pytest.mark.parametrize("limited", [False, True])
def test_kernel_weights_and_statistics(portable, n, limited):
    z = _logits(12, n, seed=n)
    limit = torch.tensor([n, n - 1, n, n, n, 1, n // 2, 0, n + 5, 2, n, n]) if limited else None
    e, stats = torch.full_like(z, 7.0), torch.empty(12, 2)
    found = torch.empty(12, 7, dtype=torch.float64)
    native.softmax_rows(z, e, stats, found, limit=limit, portable=portable)
    # the statistics: the row kernel's own, bit for bit (NaN where it gives NaN)
    assert_close(found, rowstats.row_stats(z, limit=limit, portable=portable), rtol=0, atol=0,
                 equal_nan=True)
    keys = (torch.full((12,), n) if limit is None else limit).clamp(0, n)
    seen = torch.arange(n) < keys[:, None]
    nan_row = (z.isnan() & seen).any(-1)
    assert nan_row[0] and e[nan_row].isnan().all() and stats[nan_row].isnan().all()
    ok = ~nan_row
    # the weights: e / Σ e is the softmax, with 0 at masked keys and beyond the limit
    assert_close((e[ok] * stats[ok, 1:]).double(), _softmax64(z[ok], keys[ok]),
                 rtol=2e-6, atol=1e-30)
    assert (e[ok][~seen[ok] | torch.isneginf(z[ok])] == 0).all()
    top = z.masked_fill(~seen | z.isnan(), -math.inf).amax(-1)
    has_key = ok & ~torch.isneginf(top)
    assert_close(stats[has_key, 0], top[has_key], rtol=0, atol=0)
    assert (stats[ok & ~has_key] == torch.tensor([-math.inf, 0.0])).all()


def test_kernel_refuses_weights_over_the_logits():
    z = torch.randn(4, 8)
    with pytest.raises(ValueError, match="e must not be z"):
        native.softmax_rows(z, z, torch.empty(4, 2), torch.empty(4, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows_out"):
        native.softmax_rows(z, torch.empty_like(z), torch.empty(4, 2), torch.empty(4, 7))


CASES = {  # (B, H, Nq, Nk, causal, mask shape or None)
    "causal": (2, 3, 70, 70, True, None),
    "causal Nq < Nk": (1, 2, 30, 75, True, None),
    "causal Nq > Nk": (1, 2, 75, 30, True, (1, 1, 75, 30)),
    "mask": (2, 2, 40, 66, False, (2, 1, 40, 66)),
    "per-head mask": (1, 3, 33, 33, False, (1, 3, 33, 33)),
    "one key": (1, 2, 5, 1, False, None),
}


# The block loop runs in C ("native": every call without a mask, where PyTorch exports its
# sgemm) or in Python ("python": calls with a mask, or without that sgemm); each at its default
# block and at a small one, so that blocks split rows, heads and the causal diagonal.
PATHS = {"native": (native, "NATIVE_BLOCK_ROWS", native.NATIVE_BLOCK_ROWS, 7),
         "python": (softmax_rows, "ROWS_BLOCK_ELEMENTS", softmax_rows.ROWS_BLOCK_ELEMENTS, 150)}


def _python_loop(monkeypatch) -> None:
    monkeypatch.setattr(native, "blas_sgemm", lambda: None)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("small", [False, True], ids=["default block", "small block"])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_matches_float64(monkeypatch, case, path, small, threads):
    b, h, n_q, n_k, causal, mask_shape = CASES[case]
    module, name, default, little = PATHS[path]
    monkeypatch.setattr(module, name, little if small else default)
    if path == "python":
        _python_loop(monkeypatch)
    g = torch.Generator().manual_seed(n_q * n_k)
    q, k, v = (torch.randn(b, h, n, 16, generator=g) for n in (n_q, n_k, n_k))
    mask = None if mask_shape is None else torch.rand(mask_shape, generator=g) > 0.3
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    if mask is not None:
        mask[..., 0] = True  # every query keeps a key (the pipeline's contract)
        keep = keep & mask
    found = torch.full((b, h, n_q, 7), 5.0, dtype=torch.float64)
    with num_threads(threads), torch.no_grad():
        assert softmax_rows.forms_rows(q, k, v)
        out = softmax_rows.softmax_rows_attention(q, k, v, 0.3, mask, causal, found)
    z = (q.double() @ k.double().transpose(-2, -1)) * 0.3
    p = torch.softmax(z.masked_fill(~keep, -math.inf), dim=-1)
    assert_close(out.double(), p @ v.double(), rtol=2e-5, atol=2e-6)
    z32 = ((q * 0.3) @ k.transpose(-2, -1)).masked_fill(~keep, -math.inf)
    assert_close(found, row_stats(z32), rtol=2e-5, atol=2e-6)


def test_pytorch_exports_the_sgemm_the_block_loop_calls():
    # The CPU wheels export MKL's sgemm_ from libtorch_cpu; without it every call takes the
    # Python loop, which the speed figures of the monitor do not cover.
    assert native.blas_sgemm() is not None


@pytest.mark.parametrize("layout", ["model", "grouped", "narrow values", "one query",
                                    "model, masked"])
def test_block_loops_read_strided_inputs(monkeypatch, layout):
    # A model's q is (B, N, H, d) transposed, a grouped-query model's k and v are expanded over
    # the heads (stride 0), and the values may be narrower than the keys; the output follows q's
    # order of dimensions, as SDPA's does.  With a mask the Python loop writes that output.
    monkeypatch.setattr(native, "NATIVE_BLOCK_ROWS", 5)
    monkeypatch.setattr(softmax_rows, "ROWS_BLOCK_ELEMENTS", 60)
    g = torch.Generator().manual_seed(3)
    b, h, n, d, d_v = 2, 4, 23, 8, 8
    if layout == "one query":
        n = 1
    q = torch.randn(b, n, h, d, generator=g).transpose(1, 2)
    k = torch.randn(b, n, h, d, generator=g).transpose(1, 2)
    v = torch.randn(b, n, h, d_v, generator=g).transpose(1, 2)
    if layout == "grouped":
        k = torch.randn(b, 1, n, d, generator=g).expand(b, h, n, d)
        v = torch.randn(b, 1, n, d_v, generator=g).expand(b, h, n, d_v)
    if layout == "narrow values":
        v = torch.randn(b, h, n, 3, generator=g)
    mask, keep = None, torch.ones(n, n, dtype=torch.bool).tril()
    if layout == "model, masked":
        mask = torch.rand(b, 1, n, n, generator=g) > 0.3
        mask[..., 0] = True
        keep = keep & mask
    found = torch.zeros(b, h, n, 7, dtype=torch.float64)
    with torch.no_grad():
        out = softmax_rows.softmax_rows_attention(q, k, v, 0.5, mask, True, found)
    z = (q.double() @ k.double().transpose(-2, -1)) * 0.5
    p = torch.softmax(z.masked_fill(~keep, -math.inf), dim=-1)
    assert_close(out.double(), p @ v.double(), rtol=2e-5, atol=2e-6)
    assert_close(found, row_stats(((q * 0.5) @ k.transpose(-2, -1)).masked_fill(~keep, -math.inf)),
                 rtol=2e-5, atol=2e-6)
    if layout.startswith("model"):
        assert out.transpose(1, 2).is_contiguous()


def test_native_loop_gives_the_same_bits_on_any_thread_count():
    # Each block is one thread's from start to end, so the threads only change who runs it.
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 150, 16, generator=g) for _ in range(3))
    got = []
    for threads in (1, 2):
        found = torch.zeros(2, 3, 150, 7, dtype=torch.float64)
        with num_threads(threads), torch.no_grad():
            got.append((softmax_rows.softmax_rows_attention(q, k, v, 0.3, None, True, found),
                        found))
    assert_close(got[0], got[1], rtol=0, atol=0)


def test_native_loop_refuses_bad_arguments():
    q = torch.randn(1, 2, 4, 8)
    rows = torch.zeros(1, 2, 4, 7, dtype=torch.float64)
    blocks = torch.tensor([[0, 0, 0, 4]])
    call = native.softmax_rows_attention
    with pytest.raises(ValueError, match="threads"):
        call(q, q, q, torch.empty_like(q), rows, 1.0, True, blocks, threads=0)
    with pytest.raises(ValueError, match="^q must"):
        call(q.double(), q, q, torch.empty_like(q), rows, 1.0, True, blocks, threads=1)
    with pytest.raises(ValueError, match="^k must have unit stride"):
        call(q, q.transpose(2, 3), q, torch.empty_like(q), rows, 1.0, True, blocks, threads=1)
    with pytest.raises(ValueError, match="^rows"):
        call(q, q, q, torch.empty_like(q), rows.float(), 1.0, True, blocks, threads=1)
    with pytest.raises(ValueError, match="^blocks must lie"):
        call(q, q, q, torch.empty_like(q), rows, 1.0, True, torch.tensor([[0, 2, 0, 4]]),
             threads=1)
    with pytest.raises(ValueError, match="^blocks must lie"):
        call(q, q, q, torch.empty_like(q), rows, 1.0, True, torch.tensor([[0, 0, 2, 3]]),
             threads=1)


def test_forms_rows_only_without_gradients_on_float32_cpu():
    q = torch.randn(1, 2, 4, 8)
    with torch.no_grad():
        assert softmax_rows.forms_rows(q, q, q)
        assert not softmax_rows.forms_rows(q.double(), q.double(), q.double())
        assert not softmax_rows.forms_rows(q, q[:, :1], q[:, :1])   # grouped heads
    assert not softmax_rows.forms_rows(q, q, q)                       # grad mode on


def _model() -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(32, 4, "scaled").eval()


@pytest.mark.parametrize("masked", [False, True])
def test_monitor_under_no_grad_forms_the_logits_once(monkeypatch, masked):
    mha, x = _model(), torch.randn(2, 40, 32)
    mask = None
    if masked:
        mask = torch.rand(2, 1, 40, 40) > 0.3
        mask[1, 0, 7] = False  # a query with no key
    with torch.no_grad():
        plain = mha(x, mask=mask, causal=True)
        with monitor(mha, block=7, exact_outputs=True) as exact:
            same = mha(x, mask=mask, causal=True)

        def refuse(*args, **kwargs):
            raise AssertionError("the monitor scored q kT beside the kernel")

        monkeypatch.setattr(blocks, "call_head_stats", refuse)
        with monitor(mha, block=7) as fast:
            swapped = mha(x, mask=mask, causal=True)
    assert torch.equal(same, plain)                     # exact_outputs keeps SDPA's bits
    assert_close(swapped, plain, rtol=1e-5, atol=1e-6)  # the kernel: to float32 rounding
    if masked:
        assert (swapped[1, 7] == 0).all()
    assert [r["queries"] for r in fast.records] == [r["queries"] for r in exact.records]
    for key in SCALAR_KEYS:
        assert_close(torch.tensor([r[key] for r in fast.records]),
                     torch.tensor([r[key] for r in exact.records]), rtol=1e-5, atol=1e-6,
                     msg=key)


def test_monitor_with_gradients_keeps_sdpa(monkeypatch):
    mha, x = _model(), torch.randn(2, 24, 32)
    plain = mha(x, causal=True)
    swaps = []
    monkeypatch.setattr(pipeline, "softmax_rows_attention",
                        lambda *a: swaps.append(1) or softmax_rows.softmax_rows_attention(*a))
    with monitor(mha, block=5) as mon:
        out = mha(x, causal=True)
    assert torch.equal(out, plain) and not swaps and mon.records
    with torch.no_grad(), monitor(mha, block=5):
        mha(x, causal=True)
    assert swaps  # the same call without gradients takes the kernel


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_reaches_the_outputs_sdpa_gives_it(where):
    # The rule of attnscale.kernels.nans, on the swapped call as on SDPA's
    mechanism = _model().mechanism
    q, k, v = (torch.randn(1, 4, 30, 8) for _ in range(3))
    {"q": q, "k": k, "v": v}[where][0, 1, 20, 3] = math.nan
    taken = []

    def take(seen: pipeline.Observation) -> None:
        assert seen.offers_rows and not seen.rows_exact
        seen.request_rows(taken.append)

    with torch.no_grad():
        want = pipeline.run(q, k, v, mechanism, causal=True)
        with pipeline.observe(take):
            got = pipeline.run(q, k, v, mechanism, causal=True)
    assert len(taken) == 1
    assert torch.equal(got.isnan(), want.isnan())
    assert got.isnan().any()
    assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-6)


def test_exact_outputs_must_be_a_bool():
    with pytest.raises(ConfigError, match="exact_outputs"):
        monitor(_model(), exact_outputs="yes")



def test_block_loops_copy_what_they_cannot_read_in_place():
    # A head size of 1 with the keys broadcast over the tokens (token stride 0): the C loops
    # read it from a contiguous copy (they need a token stride of at least the width).
    from attnscale.kernels.peak import head_peaks

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 7, 1, generator=g)
    k = torch.randn(1, 2, 1, 1, generator=g).expand(1, 2, 7, 1)
    v = torch.randn(1, 2, 7, 3, generator=g)
    found = torch.zeros(1, 2, 7, 7, dtype=torch.float64)
    with torch.no_grad():
        out = softmax_rows.softmax_rows_attention(q, k, v, 0.5, None, True, found)
    keep = torch.ones(7, 7, dtype=torch.bool).tril()
    z = (q.double() @ k.double().transpose(-2, -1)) * 0.5
    p = torch.softmax(z.masked_fill(~keep, -math.inf), dim=-1)
    assert_close(out.double(), p @ v.double(), rtol=2e-5, atol=2e-6)
    assert_close(head_peaks(q, k, 0.5, causal=True, screen=False),
                 z.masked_fill(~keep, -math.inf).amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-7)
