"""Seeded random streams: one rule for every experiment.

``rng(seed)`` is ``torch.Generator().manual_seed(seed)``; ``rng(seed, *cell)`` is an independent
stream for one cell of an experiment (a d_k, a mechanism name, a trial index), derived from a
stable hash of ``(seed, *cell)``, so that adding, removing or reordering cells never changes the
draws of another cell, and no experiment touches torch's global generator.
"""

from __future__ import annotations

import hashlib

import torch

from attnscale.errors import check_int


def cell_seed(seed: int, *cell: int | str) -> int:
    """The 63-bit seed of stream ``(seed, *cell)``; ``seed`` itself when there is no cell."""
    seed = check_int("seed", seed, minimum=0)
    if not cell:
        return seed
    key = repr((seed, *cell)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def rng(seed: int, *cell: int | str, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded for ``(seed, *cell)``; see the module doc."""
    return torch.Generator(device=device).manual_seed(cell_seed(seed, *cell))
