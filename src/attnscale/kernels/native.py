"""attnscale's compiled kernels, ``attnscale._kernels``: loading and availability.

The kernels are plain C (``src/attnscale/_native``) with an AVX2+FMA build chosen at run time and
a portable 128-bit one, compiled by ``pip install`` and loaded here with ctypes (which releases
the GIL during every call).  Where no C compiler was available at install time, or with the
environment variable ``ATTNSCALE_NATIVE=0``, :func:`available` is False and every caller uses its
PyTorch formulation instead:

* :func:`attnscale.kernels.rowstats.row_stats`, the monitor's per-row softmax statistics;
* the elementwise part of the soft-cap attention kernel in :mod:`attnscale.attention`.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

# Environment switch: "0" disables the compiled kernels (the PyTorch formulations are used).
NATIVE_ENV = "ATTNSCALE_NATIVE"
# Output columns of the row-statistics kernel, in its order (enum OUT_* in _native/kernels.c).
ROW_STATS_COLUMNS = ("count", "max_weight", "entropy", "jacobian_fro", "logit_std", "logit_absmax")


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
    except OSError:
        return None
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.attnscale_row_stats.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, flag]
    lib.attnscale_row_stats.restype = None
    lib.attnscale_softcap_probs.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i64,
                                            ctypes.c_float, flag]
    lib.attnscale_softcap_probs.restype = None
    lib.attnscale_softcap_grad.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, flag]
    lib.attnscale_softcap_grad.restype = None
    lib.attnscale_kernels_isa.restype = ctypes.c_char_p
    lib.attnscale_row_stats_columns.restype = ctypes.c_int
    if lib.attnscale_row_stats_columns() != len(ROW_STATS_COLUMNS):
        return None  # a stale build from another version: do not trust its layout
    return lib


def available() -> bool:
    """Whether the compiled kernels are installed and enabled."""
    return library() is not None


def isa() -> str | None:
    """Instruction set the kernels run on (``"avx2"`` or ``"v128"``), or None if unavailable."""
    lib = library()
    return None if lib is None else lib.attnscale_kernels_isa().decode()


def require() -> ctypes.CDLL:
    """The loaded kernels; RuntimeError when unavailable."""
    lib = library()
    if lib is None:
        raise RuntimeError("attnscale's compiled kernels are not available "
                           f"(built without a C compiler, or {NATIVE_ENV}=0)")
    return lib
