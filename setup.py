"""Build hook for attnscale's one compiled part, the fused row-statistics kernel of the monitor.

Everything else is declared in pyproject.toml.  The kernel is plain C (no Python or PyTorch
headers) loaded with ctypes; ``optional=True`` means a machine without a C compiler still
installs attnscale, and the monitor then computes the same statistics with PyTorch operations.
"""

import sys

from setuptools import Extension, setup

unix = sys.platform != "win32"
setup(ext_modules=[Extension(
    "attnscale._rowstats",
    sources=["src/attnscale/_native/rowstats.c"],
    depends=["src/attnscale/_native/rowstats_kernel.h"],
    extra_compile_args=["-O3", "-Wno-psabi"] if unix else [],
    libraries=["m"] if unix else [],
    optional=True,
)])
