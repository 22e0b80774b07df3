"""attnscale's compiled kernels, ``attnscale._kernels``: loading, availability and one typed
wrapper per kernel.

The kernels are plain C (``src/attnscale/_native``) with AVX-512 and AVX2+FMA builds chosen at
run time and a portable 128-bit one, compiled by ``pip install`` and loaded here with ctypes
(which releases the GIL during every call); ``ATTNSCALE_ISA=avx2`` (or ``v128``) caps every call
at that build, to time what an older CPU runs.  Where no C compiler was available at install time,
or with the environment variable ``ATTNSCALE_NATIVE=0``, :func:`available` is False and every
caller uses its PyTorch formulation instead:

* :func:`attnscale.kernels.rowstats.row_stats`, the monitor's per-row softmax statistics, and
  the same pass writing a block's softmax weights beside them
  (:mod:`attnscale.kernels.softmax_rows`);
* the elementwise part of the soft-cap attention kernel in :mod:`attnscale.kernels.softcap`;
* the row entropy and log-sum-exp of :mod:`attnscale.kernels.entropy` (adaptive temperature),
  and its bfloat16 screen's entropy, top logit and spread of bfloat16 rows;
* the bfloat16 row max of :mod:`attnscale.kernels.peak`'s screen;
* the per-row steps of softpick and stick-breaking attention (:mod:`attnscale.kernels.softpick`,
  :mod:`attnscale.kernels.stick_breaking`);
* qk-rmsnorm's RMSNorm forward and backward (:mod:`attnscale.kernels.rmsnorm`);
* two whole block loops, the monitor's softmax with its row statistics
  (:func:`softmax_rows_attention`) and the extremes of every row's logits for S_max
  (:func:`peak_rows`), which call PyTorch's own sgemm (:func:`blas_sgemm`) and spread their
  blocks over OpenMP threads;
* :func:`team`, which runs a Python function on each thread of an OpenMP team, for
  :mod:`attnscale.kernels.team`.

Callers pass tensors to :func:`row_stats_rows`, :func:`softmax_rows`, :func:`row_entropy`,
:func:`bf16_row_entropy`, :func:`bf16_row_max`, :func:`softcap_exp`, :func:`softcap_backward`,
the softpick and stick-breaking wrappers and :func:`rownorm_forward` / :func:`rownorm_backward`,
which check dtype, device, layout and shapes and pass pointers and strides on; nothing else in
attnscale touches ``data_ptr``.  :func:`cpu_bf16` says whether the CPU has bfloat16 dot
products.  Each takes ``portable``, the build to run: ``False`` (0) the best this CPU has, ``True`` (1) the portable
128-bit one, :data:`AVX2` (2) AVX2 at most; the tests run every build the CPU has.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os

import torch
from torch import Tensor

# The row-statistics kernel writes the columns of ROW_STATS_COLUMNS, in that order (enum OUT_* in
# _native/kernels.c); they are named once, in attnscale.columns.
from attnscale.columns import ROW_STATS_COLUMNS

# Environment switch: "0" disables the compiled kernels (the PyTorch formulations are used).
NATIVE_ENV = "ATTNSCALE_NATIVE"
# Environment cap on the kernels' instruction set, by isa() name: "avx2" or "v128" run that build
# on a wider CPU (to time what an AVX2 CPU runs, beside torch's ATEN_CPU_CAPABILITY=avx2).
ISA_ENV = "ATTNSCALE_ISA"
ISA_LEVELS = {"v128": 0, "avx2": 1, "avx512": 2}
# ``portable`` value that caps a call at the AVX2 build (kernels.c, build_level).
AVX2 = 2
# The kernels' contract version (attnscale_kernels_version in _native/kernels.c); a build
# reporting another one is stale and not loaded.
KERNELS_VERSION = 8
# The BLAS entry point the block loops call for their matmuls: the Fortran-interface sgemm that
# PyTorch's CPU library exports (MKL's on the x86-64 wheels), looked up in this library file.
BLAS_LIBRARY, BLAS_SGEMM = "torch_cpu", "sgemm_"
# Queries per block of the softmax C block loop (softmax_rows_attention; peak_rows has its own,
# attnscale.kernels.peak.PEAK_BLOCK_ROWS): one head each, no Python between blocks, so a block's
# logits and weights stay in a core's L2.  At B1 H4 d64 causal on an AMD EPYC (the monitor's
# softmax), 64 rows ran N = 512 and 2048 in the time of SDPA or less on 1 and 2 threads (2048 on
# 2 threads: 20.7 ms, SDPA 19.5; 32 rows 28.2, 256 rows 21.1); at N = 8192, 128 rows ran 8%
# faster on 1 thread and alike on 2.
NATIVE_BLOCK_ROWS = 64
# What attnscale_team calls on each thread of its team: fn(thread, threads).
TEAM_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when unavailable (cached; ``library.cache_clear()`` reloads)."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    spec = importlib.util.find_spec("attnscale._kernels")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        version = lib.attnscale_kernels_version
    except (OSError, AttributeError):  # unloadable, or a build older than the version check
        return None
    version.restype = ctypes.c_int
    if version() != KERNELS_VERSION:  # a stale build: it may lack kernels named below
        return None
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.attnscale_row_stats.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, flag]
    lib.attnscale_row_stats.restype = None
    lib.attnscale_softmax_rows.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr,
                                           flag]
    lib.attnscale_softmax_rows.restype = None
    lib.attnscale_softmax_rows_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64,
                                                     i64, i64, ctypes.c_float, ptr, i64, ptr,
                                                     i64, flag, ptr, flag]
    lib.attnscale_softmax_rows_attention.restype = None
    lib.attnscale_openmp.restype = ctypes.c_int
    lib.attnscale_peak_rows.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr,
                                        i64, i64, ptr, i64, flag, ptr]
    lib.attnscale_peak_rows.restype = None
    lib.attnscale_team.argtypes = [flag, TEAM_FN]
    lib.attnscale_team.restype = None
    lib.attnscale_softcap_exp.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i64, ctypes.c_float,
                                          ptr, flag]
    lib.attnscale_softcap_exp.restype = None
    lib.attnscale_softcap_backward.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64,
                                               ctypes.c_float, flag]
    lib.attnscale_softcap_backward.restype = None
    lib.attnscale_row_entropy.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, flag]
    lib.attnscale_row_entropy.restype = None
    lib.attnscale_bf16_row_max.argtypes = [ptr, i64, i64, i64, i64, ptr, flag]
    lib.attnscale_bf16_row_max.restype = None
    lib.attnscale_bf16_row_entropy.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ctypes.c_float,
                                               ptr, flag]
    lib.attnscale_bf16_row_entropy.restype = None
    lib.attnscale_softpick_probs.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr, flag]
    lib.attnscale_softpick_grad.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64,
                                            flag]
    lib.attnscale_stick_breaking_probs.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i64, flag]
    lib.attnscale_stick_breaking_grad.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64,
                                                  flag]
    lib.attnscale_rownorm_forward.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64,
                                              flag, ctypes.c_float, ctypes.c_float, i64, i64,
                                              flag]
    lib.attnscale_rownorm_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64,
                                               ptr, ptr, ptr, i64, flag, ctypes.c_float, i64,
                                               i64, i64, flag]
    for name in ("softpick_probs", "softpick_grad", "stick_breaking_probs",
                 "stick_breaking_grad", "rownorm_forward", "rownorm_backward"):
        getattr(lib, f"attnscale_{name}").restype = None
    lib.attnscale_kernels_isa.restype = ctypes.c_char_p
    lib.attnscale_cpu_bf16.restype = ctypes.c_int
    lib.attnscale_row_stats_columns.restype = ctypes.c_int
    version.restype = ctypes.c_int
    if version() != KERNELS_VERSION or lib.attnscale_row_stats_columns() != len(ROW_STATS_COLUMNS):
        return None  # a stale build from another version: do not trust its layout
    cap = os.environ.get(ISA_ENV) or "avx512"   # the library is loaded once: always set
    if cap not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)}, got {cap!r}")
    lib.attnscale_cap_isa.argtypes = [flag]
    lib.attnscale_cap_isa(ISA_LEVELS[cap])
    return lib


def available() -> bool:
    """Whether the compiled kernels are installed and enabled."""
    return library() is not None


def isa() -> str | None:
    """Instruction set the kernels run on (``"avx512"``, ``"avx2"`` or ``"v128"``), or None if
    unavailable."""
    lib = library()
    return None if lib is None else lib.attnscale_kernels_isa().decode()


def cpu_bf16() -> bool:
    """Whether the CPU has AVX512_BF16 (bfloat16 dot products); False where the kernels are
    unavailable or capped below AVX-512 (:data:`ISA_ENV`)."""
    lib = library()
    return lib is not None and bool(lib.attnscale_cpu_bf16()) and isa() == "avx512"


def require() -> ctypes.CDLL:
    """The loaded kernels; RuntimeError when unavailable."""
    lib = library()
    if lib is None:
        raise RuntimeError("attnscale's compiled kernels are not available "
                           f"(built without a C compiler, or {NATIVE_ENV}=0)")
    return lib


# ---------------------------------------------------------------------------------------------
# Typed wrappers


def _rows(name: str, t: Tensor, dtype: torch.dtype = torch.float32) -> tuple[int, int, int]:
    """(rows, width, row stride) of ``dtype`` CPU ``t`` seen as rows of its last dimension, each
    of unit stride and row r starting r · stride after the first; ValueError naming ``name``
    else."""
    if t.dtype == dtype and t.is_contiguous() and t.dim() >= 1 and t.device.type == "cpu":
        width = t.shape[-1]  # the common case, in a few microseconds: the blocks' own buffers
        return (t.numel() // width if width else 0), width, width
    if t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name} must be {str(dtype).removeprefix('torch.')} on the CPU, got "
                         f"{t.dtype} on {t.device}")
    if t.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension")
    width = t.shape[-1]
    rows = t.numel() // width if width else 0
    lead = [(size, stride) for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1]
    ld = lead[-1][1] if lead else width
    step, uniform = ld, True
    for size, stride in reversed(lead):
        uniform &= stride == step
        step *= size
    if (width > 1 and t.stride(-1) != 1) or ld < width or not uniform:
        raise ValueError(f"{name} must be rows of unit stride, evenly spaced; got shape "
                         f"{tuple(t.shape)} with strides {t.stride()}")
    return rows, width, ld


def _same_rows(name: str, t: Tensor, like: Tensor, ld: int) -> None:
    """``t`` must have ``like``'s shape and row stride (it is read or written beside it)."""
    if t.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)}, got {tuple(t.shape)}")
    if _rows(name, t)[2] != ld:
        raise ValueError(f"{name} must have the row stride of its companion tensors ({ld})")


def _limit(limit: Tensor | None) -> tuple[int | None, int]:
    """Pointer and period of an optional int64 per-row key limit."""
    if limit is None:
        return None, 1
    if limit.dtype != torch.int64 or limit.device.type != "cpu" or not limit.is_contiguous():
        raise ValueError(f"limit must be a contiguous int64 CPU tensor, got {limit.dtype} on "
                         f"{limit.device}")
    if limit.numel() < 1:
        raise ValueError("limit must have at least one entry")
    return limit.data_ptr(), limit.numel()


def row_stats_rows(z: Tensor, out: Tensor, span: tuple[int, int], *,
                   limit: Tensor | None = None, portable: int = False) -> None:
    """Statistics of rows ``span = (row0, row1)`` of float32 logits ``z`` (rows, n) into float64
    ``out`` (rows, len(ROW_STATS_COLUMNS)); row r sees its first ``limit[r % len(limit)]`` keys
    (all when None).  See :func:`attnscale.kernels.rowstats.row_stats`."""
    rows, width, ld = _rows("z", z)
    if out.shape != (rows, len(ROW_STATS_COLUMNS)) or out.dtype != torch.float64 \
            or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float64 ({rows}, {len(ROW_STATS_COLUMNS)})")
    row0, row1 = span
    if not 0 <= row0 <= row1 <= rows:
        raise ValueError(f"span must lie within [0, {rows}], got {span}")
    limit_ptr, period = _limit(limit)
    require().attnscale_row_stats(z.data_ptr(), width, ld, limit_ptr, period, row0, row1,
                                  out.data_ptr(), int(portable))


def row_entropy(z: Tensor, *, limit: Tensor | None = None, portable: int = False) -> Tensor:
    """Entropy H (nats) and log-sum-exp of softmax over the last dimension of float32 logits ``z``
    (..., n): float64 (..., 2), columns (H, lse).

    ``z = -inf`` marks a masked key, and row r of the flattened rows sees only its first
    ``limit[r % len(limit)]`` keys when ``limit`` is given.  A row without a key gives (0, 0), a
    row holding NaN or ``+inf`` (NaN, NaN).  One thread; callers split the rows.
    """
    rows, width, ld = _rows("z", z)
    out = torch.empty(*z.shape[:-1], 2, dtype=torch.float64)
    if rows and width:
        limit_ptr, period = _limit(limit)
        require().attnscale_row_entropy(z.data_ptr(), width, ld, limit_ptr, period, 0, rows,
                                        out.data_ptr(), int(portable))
    else:
        out.zero_()
    return out


def bf16_row_entropy(z: Tensor, scale: float, *, limit: Tensor | None = None,
                     portable: int = False) -> Tensor:
    """Entropy H (nats) of softmax(scale · z) over the last dimension of bfloat16 CPU logits
    ``z`` (..., n), ``scale`` > 0, with the row's largest logit scale · z and an upper bound on
    the standard deviation of the logits under its softmax (its float sums' rounding allowed
    for): float64 (..., 3).  Masking, and H for rows
    without a key or with NaN / +inf, as for :func:`row_entropy`; a row without a key gives
    (0, -inf, 0), one with a NaN or +inf NaN throughout.  One thread."""
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    rows, width, ld = _rows("z", z, torch.bfloat16)
    out = torch.empty(*z.shape[:-1], 3, dtype=torch.float64)
    if rows and width:
        limit_ptr, period = _limit(limit)
        require().attnscale_bf16_row_entropy(z.data_ptr(), width, ld, limit_ptr, period, 0, rows,
                                             float(scale), out.data_ptr(), int(portable))
    else:
        out.zero_()
        out[..., 1] = -math.inf
    return out


def bf16_row_max(z: Tensor, *, portable: int = False) -> Tensor:
    """Max over the last dimension of bfloat16 CPU ``z`` (..., n), as float32 (...); -inf for a
    row of -inf or of no key.  NaN entries are skipped (callers check finiteness).  One thread."""
    rows, width, ld = _rows("z", z, torch.bfloat16)
    out = torch.empty(z.shape[:-1], dtype=torch.float32)
    if rows:
        require().attnscale_bf16_row_max(z.data_ptr(), width, ld, 0, rows, out.data_ptr(),
                                         int(portable))
    return out


def softmax_rows(z: Tensor, e: Tensor, stats: Tensor, rows_out: Tensor, *,
                 limit: Tensor | None = None, portable: int = False) -> Tensor:
    """The softmax forward of float32 logits ``z`` (..., n) with every row's statistics: ``e``
    (like ``z``, not ``z`` itself) receives the unnormalised weights exp(z - m), ``stats`` (..., 2)
    float32 (m, 1 / Σ e) per row (the weights are e · stats[..., 1:]), and ``rows_out`` (...,
    len(ROW_STATS_COLUMNS)) float64 the statistics :func:`row_stats_rows` gives.  ``z = -inf``
    marks a masked key and row r of the flattened rows sees only its first ``limit[r %
    len(limit)]`` keys; the others get e = 0.  A row with a NaN or +inf logit among the keys it
    sees gets NaN weights (stats (NaN, NaN)), a row without a key zeros (stats (-inf, 0)).
    Returns ``e``."""
    rows, width, ld = _rows("z", z)
    _same_rows("e", e, z, ld)
    if rows and e.data_ptr() == z.data_ptr():
        raise ValueError("e must not be z (a row near one-hot reads z again)")
    _row_pair("stats", stats, z, 2)
    out_rows, out_width, _ = _rows("rows_out", rows_out, torch.float64)
    if (out_rows, out_width) != (rows, len(ROW_STATS_COLUMNS)) or not rows_out.is_contiguous():
        raise ValueError(f"rows_out must be contiguous float64 (..., {len(ROW_STATS_COLUMNS)}) "
                         f"with one row per row of z, got {tuple(rows_out.shape)}")
    limit_ptr, period = _limit(limit)
    if rows:
        require().attnscale_softmax_rows(z.data_ptr(), e.data_ptr(), width, ld, limit_ptr, period,
                                         0, rows, rows_out.data_ptr(), stats.data_ptr(),
                                         int(portable))
    return e


@functools.lru_cache(maxsize=1)
def blas_sgemm() -> int | None:
    """Address of the sgemm PyTorch's CPU library exports (:data:`BLAS_SGEMM`), or None where it
    exports none or the one it exports fails a check on a small product (looked up once).

    The block loops (:func:`softmax_rows_attention`, :func:`peak_rows`) call it from C for their
    matmuls, so that no block returns to Python; inside their OpenMP region it runs on one
    thread."""
    if library() is None:
        return None
    directory = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = [n for n in (os.listdir(directory) if os.path.isdir(directory) else [])
             if n.split(".")[0] in (f"lib{BLAS_LIBRARY}", BLAS_LIBRARY)]
    for name in names:
        try:
            address = ctypes.cast(getattr(ctypes.CDLL(os.path.join(directory, name)),
                                          BLAS_SGEMM), ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if address and _sgemm_works(address):
            return address
    return None


def _sgemm_works(address: int) -> bool:
    """Whether the sgemm at ``address`` computes a small row-major q kᵀ and e v right, called
    through the kernel itself (an odd-sized causal block of one head)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 5, 3, generator=g) for _ in range(3))
    rows = torch.zeros(1, 1, 5, len(ROW_STATS_COLUMNS), dtype=torch.float64)
    out = torch.full((1, 1, 5, 3), float("nan"))
    blocks = torch.tensor([[0, 0, 0, 5]], dtype=torch.int64)
    softmax_rows_attention(q, k, v, out, rows, 0.5, True, blocks, threads=1, gemm=address)
    z = (q[0, 0] @ k[0, 0].T).double() * 0.5
    z = z.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(z, -1) @ v[0, 0].double()
    return bool(((out[0, 0].double() - want).abs() <= 1e-5).all())


def openmp() -> bool:
    """Whether the kernels were built with OpenMP, so the block loops spread their blocks over
    threads themselves (on the calling thread's OpenMP team, PyTorch's own where both
    use libgomp)."""
    lib = library()
    return bool(lib is not None and lib.attnscale_openmp())


def team(threads: int, fn) -> None:
    """Call ``fn(thread, threads)`` on each thread of an OpenMP team of ``threads`` opened on the
    calling thread (the calling thread is thread 0), and return when all have returned; once,
    ``fn(0, 1)``, where :func:`openmp` is False.  ``fn`` must not raise (an exception cannot
    cross the C frames): :func:`attnscale.kernels.team.team_map` catches and re-raises."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    callback = TEAM_FN(fn)  # kept alive until the call returns
    require().attnscale_team(threads, callback)


def _in_place(t: Tensor) -> bool:
    """Whether the C block loops read (B, H, N, width) ``t`` as it is: unit stride along its last
    dimension and a token stride of at least its width."""
    return (t.shape[-1] <= 1 or t.stride(-1) == 1) and t.stride(2) >= max(t.shape[-1], 1)


def block_operand(t: Tensor) -> Tensor:
    """``t`` as the C block loops read it: itself where they can (see :func:`_in_place`), else a
    contiguous copy."""
    return t if _in_place(t) else t.contiguous()


def _block_operands(tensors: dict[str, Tensor]) -> None:
    """The C block loops read 4-d float32 CPU tensors of unit stride along the last dimension
    and a token stride of at least its width; ValueError naming the first that is not."""
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d float32 CPU tensor, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
        if not _in_place(t):
            raise ValueError(f"{name} must have unit stride along its last dimension and a "
                             f"token stride of at least its width, got strides {t.stride()}")


def _block_list(blocks: Tensor, n_b: int, n_h: int, n_q: int) -> int:
    """Checks (batch, head, first query, queries) ``blocks`` against (B, H, Nq); returns the
    queries of the largest block."""
    if blocks.dtype != torch.int64 or blocks.dim() != 2 or blocks.shape[1] != 4 \
            or not blocks.is_contiguous():
        raise ValueError(f"blocks must be contiguous int64 (c, 4), got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    if not len(blocks):
        return 0
    low, high = blocks.amin(0).tolist(), blocks.amax(0).tolist()
    if min(low) < 0 or high[0] >= n_b or high[1] >= n_h \
            or int((blocks[:, 2] + blocks[:, 3]).max()) > n_q:
        raise ValueError("blocks must lie inside (B, H, Nq)")
    return high[3]


def _team_size(threads: int) -> int:
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    return threads if openmp() else 1


def _sgemm(gemm: int | None) -> int:
    gemm = blas_sgemm() if gemm is None else gemm
    if gemm is None:
        raise RuntimeError("the C block loops need PyTorch's sgemm (blas_sgemm is None)")
    return gemm


def softmax_rows_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, rows: Tensor,
                           scale: float, causal: bool, blocks: Tensor, *, threads: int,
                           gemm: int | None = None, portable: int = False) -> Tensor:
    """Softmax attention of the (batch, head, first query, queries) ``blocks`` (int64 (c, 4)),
    each query's :func:`softmax_rows` statistics into ``rows``: out = softmax(scale q kᵀ) v,
    under top-left causality when ``causal``, in one call (:mod:`attnscale.kernels.softmax_rows`),
    spread over ``threads`` OpenMP threads (1 where :func:`openmp` is False), which take the blocks
    in their order.

    q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, d_v), out (B, H, Nq, d_v): float32 CPU, each
    with unit stride along its last dimension and a token stride of at least its width; rows
    float64 (B, H, Nq, len(ROW_STATS_COLUMNS)) with a contiguous last dimension.  ``gemm``: the
    sgemm to call (default :func:`blas_sgemm`).  Returns ``out``."""
    gemm, threads = _sgemm(gemm), _team_size(threads)
    _block_operands({"q": q, "k": k, "v": v, "out": out})
    n_b, n_h, n_q, d = q.shape
    if (k.shape[:2] != (n_b, n_h) or k.shape[-1] != d or v.shape[:3] != k.shape[:3]
            or out.shape != (n_b, n_h, n_q, v.shape[-1])):
        raise ValueError(f"q, k, v and out shapes disagree: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(out.shape)}")
    if (rows.dtype != torch.float64 or rows.shape != (n_b, n_h, n_q, len(ROW_STATS_COLUMNS))
            or rows.stride(-1) != 1):
        raise ValueError(f"rows must be float64 {(n_b, n_h, n_q, len(ROW_STATS_COLUMNS))} with "
                         f"a contiguous last dimension, got {rows.dtype} {tuple(rows.shape)}")
    largest = _block_list(blocks, n_b, n_h, n_q)
    if not largest:
        return out
    per_thread = largest * (2 * k.shape[2] + 2)
    scratch = torch.empty(threads * per_thread)
    strides = (ctypes.c_int64 * 15)(*(s for t in (q, k, v, out, rows) for s in t.stride()[:3]))
    require().attnscale_softmax_rows_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), rows.data_ptr(), strides, d,
        v.shape[-1], k.shape[2], int(causal), scale, blocks.data_ptr(), len(blocks),
        scratch.data_ptr(), per_thread, threads, gemm, int(portable))
    return out


def peak_rows(q: Tensor, k: Tensor, top: Tensor, low: Tensor, causal: bool, blocks: Tensor, *,
              threads: int, gemm: int | None = None) -> None:
    """The largest and smallest raw logit q kᵀ of every query of the (batch, head, first query,
    queries) ``blocks`` over the keys it attends (all, or the causal prefix), into ``top`` and
    ``low``, float32 (B, H, Nq) contiguous: NaN for a row with a NaN logit, -inf and +inf for a
    row without a key.  q (B, H, Nq, d), k (B, Hk, Nk, d) with H a multiple of Hk (query head h
    reads key head h // (H // Hk)), float32 CPU as for :func:`softmax_rows_attention`; spread
    over ``threads`` OpenMP threads in one call (:mod:`attnscale.kernels.peak`)."""
    gemm, threads = _sgemm(gemm), _team_size(threads)
    _block_operands({"q": q, "k": k})
    n_b, n_h, n_q, d = q.shape
    if k.shape[0] != n_b or k.shape[-1] != d or k.shape[1] < 1 or n_h % k.shape[1]:
        raise ValueError(f"q and k shapes disagree: {tuple(q.shape)}, {tuple(k.shape)}")
    for name, t in (("top", top), ("low", low)):
        if t.dtype != torch.float32 or t.shape != (n_b, n_h, n_q) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 {(n_b, n_h, n_q)}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    largest = _block_list(blocks, n_b, n_h, n_q)
    if not largest:
        return
    per_thread = largest * k.shape[2]
    scratch = torch.empty(threads * per_thread)
    strides = (ctypes.c_int64 * 6)(*q.stride()[:3], *k.stride()[:3])
    require().attnscale_peak_rows(
        q.data_ptr(), k.data_ptr(), strides, d, k.shape[2], int(causal), n_h // k.shape[1],
        blocks.data_ptr(), len(blocks), top.data_ptr(), low.data_ptr(), n_h, n_q,
        scratch.data_ptr(), per_thread, threads, gemm)

def softcap_exp(s: Tensor, cap: float, stats: Tensor, *, out: Tensor | None = None,
                limit: Tensor | None = None, portable: int = False) -> Tensor:
    """The soft-cap forward's weights unnormalised: e = exp(cap · tanh(s) - m) of float32 logits
    ``s`` (..., n), m the row's largest cap · tanh(s), with ``stats`` (..., 2) float32 receiving
    (m, 1 / Σ e) per row: the weights are e · stats[..., 1:].  ``s = -inf`` marks a masked key
    and row r of the flattened rows sees only its first ``limit[r % len(limit)]`` keys
    (causality without a mask); the others get e = 0.  A row holding NaN among the keys it sees
    is NaN there (stats (NaN, NaN)), a row without a key all 0 (stats (-inf, 0)).  ``out``
    (default new) may be ``s``.  Returns ``out``."""
    rows, width, ld = _rows("s", s)
    out = _out_like(s, out, ld)
    _row_pair("stats", stats, s, 2)
    limit_ptr, period = _limit(limit)
    if rows:
        require().attnscale_softcap_exp(s.data_ptr(), out.data_ptr(), width, ld, limit_ptr, period,
                                        0, rows, float(cap), stats.data_ptr(), int(portable))
    return out


def softcap_backward(s: Tensor, dp: Tensor, stats: Tensor, delta: Tensor, cap: float, *,
                     limit: Tensor | None = None, portable: int = False) -> tuple[Tensor, Tensor]:
    """The soft-cap backward in one pass over a block, in place: ``s`` (the logits the forward
    had, float32 (..., n)) becomes the weights p = exp(cap · tanh(s) - m) / Σ from the forward's
    :func:`softcap_exp` ``stats``, and ``dp`` (dL/dp) becomes p ∘ (dp - δ) ∘ (1 - tanh² s), with
    ``delta`` δ (..., 1) per row.  Keys masked or beyond ``limit`` get p = 0.  Returns (p, dp)."""
    rows, width, ld, delta, limit_ptr, period = _backward_rows(s, dp, stats, delta, limit)
    if rows:
        require().attnscale_softcap_backward(s.data_ptr(), dp.data_ptr(), stats.data_ptr(),
                                             delta.data_ptr(), width, ld, limit_ptr, period, 0,
                                             rows, float(cap), int(portable))
    return s, dp


def _row_pair(name: str, t: Tensor, like: Tensor, width: int = 1) -> Tensor:
    """``t``: float32 CPU, ``width`` values per row of ``like`` (..., n), contiguous."""
    want = (*like.shape[:-1], width)
    if t.shape != want or t.dtype != torch.float32 or t.device.type != "cpu" \
            or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor of shape {want}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t


def _backward_rows(s: Tensor, dp: Tensor, stats: Tensor, delta: Tensor,
                   limit: Tensor | None) -> tuple:
    """The checked arguments of a row backward reading logits ``s``, writing ``dp`` in place,
    with two floats of forward ``stats`` and one ``delta`` per row: (rows, width, row stride,
    delta contiguous, limit pointer, limit period)."""
    rows, width, ld = _rows("s", s)
    _same_rows("dp", dp, s, ld)
    _row_pair("stats", stats, s, 2)
    delta = _row_pair("delta", delta.contiguous(), s)
    return (rows, width, ld, delta, *_limit(limit))


def _out_like(s: Tensor, out: Tensor | None, ld: int) -> Tensor:
    if out is None:
        out = torch.empty_strided(s.shape, s.stride(), dtype=s.dtype)
    _same_rows("out", out, s, ld)
    return out


def softpick_probs(s: Tensor, stats: Tensor, *, out: Tensor | None = None,
                   limit: Tensor | None = None, portable: int = False) -> Tensor:
    """Softpick weights of float32 logits ``s`` (..., n) (see :mod:`attnscale.kernels.softpick`):
    ``s = -inf`` marks a masked key, row r sees its first ``limit[r % len(limit)]`` keys, the rest
    get 0.  ``stats`` (..., 2) float32 receives each row's shift M and denominator D, which
    :func:`softpick_grad` reads.  ``out`` (default new) may be ``s``.  Returns ``out``."""
    rows, width, ld = _rows("s", s)
    out = _out_like(s, out, ld)
    _row_pair("stats", stats, s, 2)
    limit_ptr, period = _limit(limit)
    if rows:
        require().attnscale_softpick_probs(s.data_ptr(), out.data_ptr(), width, ld, limit_ptr,
                                           period, 0, rows, stats.data_ptr(), int(portable))
    return out


def softpick_grad(s: Tensor, dp: Tensor, stats: Tensor, delta: Tensor, *,
                  limit: Tensor | None = None, portable: int = False) -> Tensor:
    """Softpick's backward in place on ``dp`` (dL/dp -> dL/ds), from the logits ``s``,
    :func:`softpick_probs`' ``stats`` and ``delta`` = Σ_j dp_j p_j per row (..., 1).  Returns
    ``dp``."""
    rows, width, ld, delta, limit_ptr, period = _backward_rows(s, dp, stats, delta, limit)
    if rows:
        require().attnscale_softpick_grad(s.data_ptr(), dp.data_ptr(), stats.data_ptr(),
                                          delta.data_ptr(), width, ld, limit_ptr, period, 0,
                                          rows, int(portable))
    return dp


def stick_breaking_probs(s: Tensor, *, out: Tensor | None = None, limit: Tensor | None = None,
                         portable: int = False) -> Tensor:
    """Stick-breaking weights of float32 logits ``s`` (..., n), keys in order, the nearest last
    (see :mod:`attnscale.kernels.stick_breaking`); masking as for :func:`softpick_probs`.
    ``out`` (default new) must not be ``s``.  Returns ``out``."""
    rows, width, ld = _rows("s", s)
    out = _out_like(s, out, ld)
    if rows and out.data_ptr() == s.data_ptr():
        raise ValueError("out must not share memory with s")
    limit_ptr, period = _limit(limit)
    if rows:
        require().attnscale_stick_breaking_probs(s.data_ptr(), out.data_ptr(), width, ld,
                                                 limit_ptr, period, 0, rows, int(portable))
    return out


def stick_breaking_grad(s: Tensor, p: Tensor, dp: Tensor, *, limit: Tensor | None = None,
                        portable: int = False) -> Tensor:
    """Stick-breaking's backward in place on ``dp`` (dL/dp -> dL/ds), from the logits ``s`` and
    the weights ``p`` of :func:`stick_breaking_probs`, which it overwrites.  Returns ``dp``."""
    rows, width, ld = _rows("s", s)
    _same_rows("p", p, s, ld)
    _same_rows("dp", dp, s, ld)
    limit_ptr, period = _limit(limit)
    if rows:
        require().attnscale_stick_breaking_grad(s.data_ptr(), p.data_ptr(), dp.data_ptr(), width,
                                                ld, limit_ptr, period, 0, rows, int(portable))
    return dp


# ---------------------------------------------------------------------------------------------
# RMSNorm rows (qk-rmsnorm): x (A, H, C, d) addressed by strides, one token = (a, c)

# Tokens whose float partial sums of the gain's gradient are added into its float64 total at
# once (at token indices that are multiples of it): 64 float terms per sum.
FOLD_TOKENS = 64


class RowGeometry:
    """How the RMSNorm kernels address x (A, H, C, d): the sizes, and per tensor the float
    strides of its a, h and c dimensions (each row d floats of unit stride)."""

    def __init__(self, x: Tensor):
        if x.dim() != 4:
            raise ValueError(f"x must be (A, H, C, d), got shape {tuple(x.shape)}")
        self.n_a, self.n_h, self.n_c, self.d = x.shape
        self.tokens = self.n_a * self.n_c

    def strides(self, name: str, t: Tensor) -> ctypes.Array:
        """t's (a, h, c) strides as a C int64 array; ValueError unless t is float32 CPU of x's
        shape with rows of unit stride."""
        if t.shape != (self.n_a, self.n_h, self.n_c, self.d) or t.dtype != torch.float32 \
                or t.device.type != "cpu" or (self.d > 1 and t.stride(-1) != 1):
            raise ValueError(f"{name} must be float32 on the CPU, of shape "
                             f"{(self.n_a, self.n_h, self.n_c, self.d)} with rows of unit "
                             f"stride; got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
        return (ctypes.c_int64 * 3)(*t.stride()[:3])

    def check(self, rho: Tensor, grouped: bool, span: tuple[int, int]) -> tuple[int, int]:
        """``span`` (t0, t1), after checking it and ``rho``: contiguous float32 (A, H, C), or
        (A, C) when ``grouped``."""
        want = (self.n_a, self.n_c) if grouped else (self.n_a, self.n_h, self.n_c)
        if rho.shape != want or rho.dtype != torch.float32 or not rho.is_contiguous():
            raise ValueError(f"rho must be a contiguous float32 {want}")
        t0, t1 = span
        if not 0 <= t0 <= t1 <= self.tokens:
            raise ValueError(f"span must lie within [0, {self.tokens}], got {span}")
        return t0, t1


def _gain(gain: Tensor | None, geometry: RowGeometry) -> tuple[int | None, int]:
    """Pointer and per-row stride of a gain: (d,) shared by the rows, or (H, 1, d) per head."""
    if gain is None:
        return None, 0
    if gain.dtype != torch.float32 or gain.device.type != "cpu" or not gain.is_contiguous():
        raise ValueError("gain must be a contiguous float32 CPU tensor")
    if gain.numel() == geometry.d:
        return gain.data_ptr(), 0
    if gain.numel() == geometry.n_h * geometry.d:
        return gain.data_ptr(), geometry.d
    raise ValueError(f"gain must hold d = {geometry.d} or H d = {geometry.n_h * geometry.d} "
                     f"values, got {gain.numel()}")


def rownorm_forward(x: Tensor, y: Tensor, rho: Tensor, gain: Tensor | None, *, m: float,
                    eps: float, grouped: bool, span: tuple[int, int],
                    portable: int = False) -> None:
    """RMSNorm of tokens ``span`` = (t0, t1) of x (A, H, C, d) into y (x's shape, any layout
    with unit-stride rows): y = gain · x · ρ, ρ = (Σ x² / m + eps)^(-1/2) over each row, or
    with ``grouped`` over the H rows of each token.  ``rho``: contiguous float32 (A, H, C)
    (or (A, C) grouped) receiving ρ.  One thread; callers split the tokens."""
    geo = RowGeometry(x)
    xs, ys = geo.strides("x", x), geo.strides("y", y)
    t0, t1 = geo.check(rho, grouped, span)
    w, w_h = _gain(gain, geo)
    require().attnscale_rownorm_forward(x.data_ptr(), y.data_ptr(), rho.data_ptr(), w, geo.d,
                                        geo.n_h, geo.n_c, xs, ys, w_h, int(grouped), float(m),
                                        float(eps), t0, t1, int(portable))


def rownorm_backward(x: Tensor, g: Tensor, dx: Tensor, rho: Tensor, gain: Tensor | None,
                     d_gain: Tensor | None, *, m: float, grouped: bool, span: tuple[int, int],
                     portable: int = False) -> None:
    """The backward of :func:`rownorm_forward` for tokens ``span``: dx (x's shape, any layout
    with unit-stride rows) from the incoming gradient g and the forward's ``rho``; with
    ``d_gain`` (contiguous float64 of the gain's shape) Σ ρ g x over the tokens' rows is added
    into it, in float32 sums over the tokens between multiples of :data:`FOLD_TOKENS`.  One
    thread; callers split the tokens (at such multiples, for sums that do not depend on the
    split), each with its own ``d_gain``."""
    geo = RowGeometry(x)
    xs, gs, dxs = geo.strides("x", x), geo.strides("g", g), geo.strides("dx", dx)
    t0, t1 = geo.check(rho, grouped, span)
    w, w_h = _gain(gain, geo)
    dw = part = None
    if d_gain is not None:
        if gain is None or d_gain.shape != gain.shape or d_gain.dtype != torch.float64 \
                or not d_gain.is_contiguous():
            raise ValueError("d_gain must be a contiguous float64 tensor of the gain's shape")
        part = torch.zeros(d_gain.numel(), dtype=torch.float32)
        dw = d_gain.data_ptr()
    require().attnscale_rownorm_backward(x.data_ptr(), g.data_ptr(), dx.data_ptr(),
                                         rho.data_ptr(), w, dw,
                                         None if part is None else part.data_ptr(), geo.d,
                                         geo.n_h, geo.n_c, xs, gs, dxs, w_h, int(grouped),
                                         float(m), FOLD_TOKENS, t0, t1, int(portable))
