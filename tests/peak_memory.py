"""The peak memory of a call, as the benchmarks measure it: resident set size in a fresh child
process (Linux's VmHWM, reset to the current RSS just before the call), which sees torch's
allocations as well as Python's (``tracemalloc`` sees neither torch's nor numpy's own buffers)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PROBE = """
def _kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
{setup}
{warm}
_before = _kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again at the current RSS
{call}
print((_kib("VmHWM") - _before) / 1024)
"""


def peak_mib(setup: str, call: str, warm: str = "") -> float:
    """MiB the resident set grew to at its peak while ``call`` ran, after ``setup`` (imports)
    and ``warm`` (a small call first, so lazy initialisation and thread pools do not count)."""
    code = _PROBE.format(setup=textwrap.dedent(setup), warm=textwrap.dedent(warm),
                         call=textwrap.dedent(call))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the memory probe failed:\n{done.stderr}")
    return float(done.stdout.split()[-1])
