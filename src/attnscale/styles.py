"""One fixed plot style per mechanism, used by every figure attnscale draws.

A style is a colour, a line style and a marker, so two mechanisms stay apart in a legend even
where colours are hard to tell apart (or printed in grey).  :func:`style` returns it as keyword
arguments for matplotlib's ``Axes.plot``::

    ax.plot(x, y, label=name, **style(name))
    ax.plot(steps, loss, label=name, **style(name, markevery=0.1))   # dense curve: few markers
    ax.fill_between(x, lo, hi, color=style(name)["color"], alpha=0.2)

Where a style comes from, for a name:

1. :data:`STYLES`, the fixed table: every mechanism known when it was written.  The essay draws
   scaled blue and unscaled green, so they keep those colours.
2. A registry mechanism that is not in the table gets the first free slot of :func:`_slots`,
   probed from a stable hash of its name (CRC-32, not Python's per-process ``hash``), taken in
   registry order.  It never changes when mechanisms are added after it, and it never collides
   with the table or with another registry mechanism.
3. Any other label (a variant such as "qk-layernorm, no divisor") hashes the same way, avoiding the
   table and the registry; two such labels could share a slot, so pass explicit overrides
   (``style(base, linestyle=":")``) where a figure needs them apart.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

# matplotlib's tab10 (the default colour cycle) plus five colours far from all of them.
PALETTE = (
    "#1f77b4", "#2ca02c", "#ff7f0e", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#000000", "#000080", "#008080", "#e6ab02", "#800000",
)
MARKERS = ("o", "s", "^", "v", "<", ">", "D", "P", "X", "*", "h", "p", "d", "H", "8")
LINESTYLES = ("-", "--", "-.", ":")

# name: (colour, line style, marker).  Siblings of another mechanism (init-reparam of scaled,
# sigma-reparam, qk-clip: temperatures that live in the weights) are dashed.
STYLES: dict[str, tuple[str, str, str]] = {
    "scaled": ("#1f77b4", "-", "o"),          # blue, as in the essay's figures
    "unscaled": ("#2ca02c", "-", "s"),        # green, as in the essay's figures
    "init-reparam": ("#000080", "--", "D"),
    "qknorm": ("#ff7f0e", "-", "^"),
    "qk-layernorm": ("#d62728", "-", "v"),
    "qk-rmsnorm": ("#e377c2", "-", "<"),
    "cosine": ("#9467bd", "-", ">"),
    "learned-temp": ("#8c564b", "-", "P"),
    "mup": ("#bcbd22", "-", "X"),
    "softcap": ("#7f7f7f", "-", "*"),
    "yarn": ("#17becf", "-", "h"),
    "sigma-reparam": ("#008080", "--", "d"),
    "ssmax": ("#000000", "-", "p"),
    "llama4-temp": ("#e6ab02", "-", "H"),
    "qk-clip": ("#800000", "--", "8"),
    # The mechanisms of 2024-2026, in colours outside PALETTE (so no fallback takes them).
    # Another normaliser (sink, sigmoid) is dotted, a rule on top of scaled attention
    # (adaptive-temp, gated) dash-dotted, and siblings (logn of ssmax, clip-qkv of softcap) dashed
    # in a colour near theirs.
    "logn": ("#556b2f", "--", "p"),
    "sink": ("#4682b4", ":", "s"),
    "sigmoid": ("#ff1493", ":", "o"),
    "adaptive-temp": ("#4b0082", "-.", "^"),
    "gated": ("#b8860b", "-.", "D"),
    "clip-qkv": ("#a9a9a9", "--", "X"),
    # softpick and stick-breaking are other normalisers (dotted); mscale, DeepSeek's form of
    # yarn's rule, is dashed in a colour near yarn's.
    "softpick": ("#dc143c", ":", "v"),
    "stick-breaking": ("#2e8b57", ":", "D"),
    "mscale": ("#5f9ea0", "--", "h"),
    # Logit biases (forgetting, selective) dash-dotted like the other rules on top of scaled
    # attention; differential attention, another normaliser, dotted.
    "forgetting": ("#228b22", "-.", "v"),
    "selective": ("#cd5c5c", "-.", "<"),
    "differential": ("#00ced1", ":", "P"),
}


def _slots() -> tuple[tuple[str, str, str], ...]:
    """Every (colour, line style, marker) a fallback may take, in a fixed order: each colour with
    each line style, the marker chosen so that neighbouring slots differ in all three."""
    return tuple((c, ls, MARKERS[(i + 7 * j) % len(MARKERS)])
                 for j, ls in enumerate(LINESTYLES) for i, c in enumerate(PALETTE))


def _probe(name: str, taken: set[tuple[str, str, str]]) -> tuple[str, str, str]:
    """The first slot not in ``taken``, starting at the CRC-32 of ``name`` (stable everywhere)."""
    slots = _slots()
    start = zlib.crc32(name.encode("utf-8")) % len(slots)
    for k in range(len(slots)):
        slot = slots[(start + k) % len(slots)]
        if slot not in taken:
            return slot
    raise RuntimeError(f"no free plot style for {name!r}: more than {len(slots)} mechanisms")


@lru_cache(maxsize=8)
def _assigned(registry: tuple[str, ...]) -> dict[str, tuple[str, str, str]]:
    """The table, plus a probed slot for each registry name it lacks, in registry order."""
    out = dict(STYLES)
    taken = set(out.values())
    for name in registry:
        if name not in out:
            out[name] = _probe(name, taken)
            taken.add(out[name])
    return out


def style(name: str, **overrides) -> dict:
    """Plot keyword arguments (``color``, ``linestyle``, ``marker``) of mechanism ``name``;
    ``overrides`` replace or add keys (``markevery``, ``lw``, ...)."""
    from attnscale.mechanisms import MECHANISMS
    assigned = _assigned(tuple(MECHANISMS))
    slot = assigned.get(name) or _probe(name, set(assigned.values()))
    color, linestyle, marker = slot
    return {"color": color, "linestyle": linestyle, "marker": marker, **overrides}


# One colour per row of the fixed table: the table itself must never repeat a style.
if len(set(STYLES.values())) != len(STYLES) or \
        len({c for c, _, _ in STYLES.values()}) != len(STYLES):  # pragma: no cover - edit guard
    raise RuntimeError("STYLES repeats a colour or a style")
