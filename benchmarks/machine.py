"""What a benchmark ran on: the instruction set of attnscale's compiled kernels and the SDPA
kernel PyTorch picks, printed by every benchmark in this folder, because the ratios depend on
both (SDPA's float32 forward + backward at B4 H8 N1024 d64 takes about 108 ms on a CPU with
AMX and about 250 ms on one without; the soft-cap, monitor and guard ratios moved with it).

    import machine                       # benchmarks/ is on sys.path when a script runs
    print(machine.describe(shape=(4, 8, 1024, 64), causal=True))

To time what an AVX2 CPU runs, on a wider one, cap both torch and attnscale (oneDNN and MKL
have their own caps)::

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        ATTNSCALE_ISA=avx2 python benchmarks/bench_mechanisms.py

``describe`` gives one line, for instance::

    instruction set: AVX-512 (attnscale kernels avx512, torch AVX512); SDPA kernel: flash
    (float32 (4, 8, 1024, 64) causal, cpu)
"""

from __future__ import annotations

import os

import torch

from attnscale.kernels import native, peak

# attnscale.kernels.native.isa() names -> how the CPU generations are called.
_ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2", "v128": "portable 128-bit"}
# torch.nn.attention.SDPBackend member names -> short names.
_SDPA_NAMES = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "MATH": "math",
               "CUDNN_ATTENTION": "cuDNN", "OVERRIDEABLE": "overrideable", "ERROR": "none"}


def instruction_set() -> str:
    """The CPU generation attnscale's compiled kernels run on: "AVX-512 with AMX", "AVX-512 with
    BF16 (no AMX)" (bfloat16 dot products: AMD Zen 4 and later), "AVX-512", "AVX2", "portable
    128-bit", or a note that they are not built (PyTorch formulations)."""
    isa = native.isa()
    if isa is None:
        return f"none (compiled kernels not available or {native.NATIVE_ENV}=0)"
    name = _ISA_NAMES.get(isa, isa)
    if isa == "avx512" and peak.amx():
        name += " with AMX"
    elif isa == "avx512" and native.cpu_bf16():
        name += " with BF16 (no AMX)"
    return name


def sdpa_kernel(shape=(4, 8, 1024, 64), dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", *, causal: bool = False,
                mask: bool = False) -> str:
    """The kernel ``scaled_dot_product_attention`` picks for q, k, v of ``shape`` (B, H, N, d),
    ``dtype`` and ``device`` (with a boolean mask when ``mask``): "flash", "efficient", "math",
    "cuDNN", or "unknown" where this torch cannot say (``torch._fused_sdp_choice`` is how SDPA
    itself chooses; it is not public API)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown"
    try:
        from torch.nn.attention import SDPBackend
        q = torch.empty(shape, dtype=dtype, device=device)
        m = torch.ones(shape[-2], shape[-2], dtype=torch.bool, device=device) if mask else None
        return _SDPA_NAMES.get(SDPBackend(choose(q, q, q, m, 0.0, causal and not mask)).name,
                               "unknown")
    except (ImportError, RuntimeError, ValueError, TypeError):
        return "unknown"


def describe(shape=None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             *, causal: bool = False, mask: bool = False) -> str:
    """One line: the instruction set, torch's own CPU capability, and the SDPA kernel for the
    benchmark's attention call (``shape`` None: the benchmark calls no attention)."""
    line = (f"instruction set: {instruction_set()} (attnscale kernels {native.isa() or 'none'}, "
            f"torch {torch.backends.cpu.get_cpu_capability()})")
    if shape is None:
        return line + "; SDPA kernel: not used by this benchmark"
    what = f"{str(dtype).removeprefix('torch.')} {tuple(shape)}"
    what += " causal" if causal else " masked" if mask else ""
    return (line + f"; SDPA kernel: {sdpa_kernel(shape, dtype, device, causal=causal, mask=mask)}"
            f" ({what}, {torch.device(device)})")


def load() -> str:
    """The load average over 1, 5 and 15 minutes and the CPU count, for every timing line."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"
