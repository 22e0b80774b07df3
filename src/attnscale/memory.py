"""Refuse a request too large for memory up front: attnscale's one memory check.

A request's working set ``need`` (bytes, an upper estimate made by the caller before any work)
is compared with what its device can give:

* on the CPU, :data:`MEMORY_FRACTION` of the machine's physical RAM (a fixed budget, so whether a
  request is refused does not depend on what else happens to be running);
* on a CUDA device, the device memory free now (``torch.cuda.mem_get_info``).

Where the OS or the device does not say, nothing is refused.
"""

from __future__ import annotations

import os

import torch

from attnscale.errors import ConfigError

# Refuse a request whose working set exceeds this fraction of the machine's physical memory.
MEMORY_FRACTION = 0.5


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def memory_budget(device: str | torch.device = "cpu") -> tuple[int, str] | None:
    """Bytes a request on ``device`` may use at once and a phrase saying where that comes from
    (see the module doc), or None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free, f"the {free / 2**30:,.1f} GiB free on {device}"
    ram = physical_memory()
    if ram is None:
        return None
    return int(MEMORY_FRACTION * ram), (f"{MEMORY_FRACTION:.0%} of this machine's "
                                        f"{ram / 2**30:,.1f} GiB")


def check_memory(what: str, need: int, device: str | torch.device = "cpu", *,
                 hint: str = "use a smaller value") -> None:
    """Refuse a request whose working set ``need`` (bytes) exceeds ``device``'s budget.

    ``what`` names the request (``"n=100000000000"``), ``hint`` what to change; the one-line
    :class:`~attnscale.errors.ConfigError` says how much it needs and how much there is.
    """
    budget = memory_budget(device)
    if budget is not None and need > budget[0]:
        raise ConfigError(f"{what} would need about {need / 2**30:,.1f} GiB of memory at once, "
                          f"more than {budget[1]}; {hint}.")
