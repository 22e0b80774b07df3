"""Build hook for attnscale's one compiled part, ``attnscale._kernels`` (see
attnscale.kernels.native).

Everything else is declared in pyproject.toml.  The kernels are plain C (no Python or PyTorch
headers) loaded with ctypes; ``optional=True`` means a machine without a C compiler still
installs attnscale, whose callers then use their PyTorch formulations.  The build asks for OpenMP
(GNU's libgomp, the runtime PyTorch's Linux wheels load) and builds without it where the compiler
has none.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

unix = sys.platform != "win32"
OPENMP = ["-fopenmp"] if unix else []


class BuildWithOpenMP(build_ext):
    """Build the kernels with OpenMP, and again without it if that fails."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception:  # a compiler or linker without OpenMP
            if not OPENMP:
                raise
            ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in OPENMP]
            ext.extra_link_args = [a for a in ext.extra_link_args if a not in OPENMP]
            super().build_extension(ext)


setup(cmdclass={"build_ext": BuildWithOpenMP}, ext_modules=[Extension(
    "attnscale._kernels",
    sources=["src/attnscale/_native/kernels.c"],
    depends=["src/attnscale/_native/simd.h", "src/attnscale/_native/rowstats_kernel.h",
             "src/attnscale/_native/softcap_kernel.h", "src/attnscale/_native/entropy_kernel.h",
             "src/attnscale/_native/peak_kernel.h", "src/attnscale/_native/rectified_kernel.h",
             "src/attnscale/_native/rownorm_kernel.h",
             "src/attnscale/_native/kernel_set.h"],
    extra_compile_args=["-O3", "-Wno-psabi", *OPENMP] if unix else [],
    extra_link_args=OPENMP,
    libraries=["m"] if unix else [],
    optional=True,
)])
