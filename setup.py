"""Build hook for attnscale's one compiled part, ``attnscale._kernels`` (see
attnscale.kernels.native).

Everything else is declared in pyproject.toml.  The kernels are plain C (no Python or PyTorch
headers) loaded with ctypes; ``optional=True`` means a machine without a C compiler still
installs attnscale, whose callers then use their PyTorch formulations.
"""

import sys

from setuptools import Extension, setup

unix = sys.platform != "win32"
setup(ext_modules=[Extension(
    "attnscale._kernels",
    sources=["src/attnscale/_native/kernels.c"],
    depends=["src/attnscale/_native/simd.h", "src/attnscale/_native/rowstats_kernel.h",
             "src/attnscale/_native/softcap_kernel.h", "src/attnscale/_native/entropy_kernel.h",
             "src/attnscale/_native/peak_kernel.h", "src/attnscale/_native/rectified_kernel.h",
             "src/attnscale/_native/rownorm_kernel.h",
             "src/attnscale/_native/kernel_set.h"],
    extra_compile_args=["-O3", "-Wno-psabi"] if unix else [],
    libraries=["m"] if unix else [],
    optional=True,
)])
