"""Every attention-temperature mechanism, by name.

:data:`MECHANISMS` maps each registry key to its :class:`Mechanism` class; each lives in its own
file and enters the registry with ``@register(name)``.  Every module of this folder is imported
here: the ones listed below first, in the order of the registry (the order of report rows and
legends), then any other, by file name.  Adding a mechanism therefore means adding one file (and its
formula row in tests/test_mechanisms.py); the test suite is parametrised over the registry.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import typing
from collections.abc import Iterable

from attnscale.errors import ConfigError, did_you_mean
from attnscale.mechanisms.base import MECHANISMS, Mechanism, register

# Explicit imports, in the order of the README's mechanism table; importing a module registers
# its mechanism.
from attnscale.mechanisms import scaled, unscaled, init_reparam, qknorm  # noqa: E402,F401
from attnscale.mechanisms import qk_layernorm, qk_rmsnorm, cosine, learned_temp  # noqa: E402,F401
from attnscale.mechanisms import mup, softcap, yarn, sigma_reparam, ssmax  # noqa: E402,F401
from attnscale.mechanisms import llama4_temp, qk_clip, logn, sink, sigmoid  # noqa: E402,F401
from attnscale.mechanisms import adaptive_temp, gated, clip_qkv  # noqa: E402,F401

# Then every other module of this folder (a new mechanism's file), sorted by name.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
del _module

__all__ = ["MECHANISMS", "Mechanism", "build_mechanism", "check_mechanism", "defined_at_init",
           "mechanism_options", "option_types", "parse_option", "register"]


def defined_at_init() -> tuple[str, ...]:
    """The mechanisms whose temperature is a rule on q and k known at init (no trained weights),
    in registry order: those the Monte Carlo experiments can measure."""
    return tuple(name for name, cls in MECHANISMS.items() if cls.defined_at_init)


def mechanism_options(name: str) -> tuple[str, ...]:
    """The options ``name`` accepts: keyword-only arguments of its ``__init__``."""
    params = inspect.signature(MECHANISMS[name].__init__).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def option_types(name: str) -> dict[str, type]:
    """The declared type of each option of ``name`` that has a plain one (bool, int, float, str),
    read from the annotations of its ``__init__``."""
    hints = typing.get_type_hints(MECHANISMS[name].__init__)
    return {option: hints[option] for option in mechanism_options(name)
            if hints.get(option) in (bool, int, float, str)}


def parse_option(name: str, key: str, text: str, *, param: str = "--option") -> object:
    """The value of option ``key`` of mechanism ``name`` written as ``text`` (``KEY=VALUE`` on a
    command line, ``name(key=value)`` in a variant), read by the option's declared type: the one
    rule every command that takes mechanism options uses.

    bool: ``true`` / ``false`` (any case); int: an integer, or a float with an integral value
    (``1e3``); float: any float; str: the text.  An option without a plain declared type (or one
    the mechanism does not take, which :func:`check_mechanism` then reports) reads as an int,
    else a float, else the text.  A value that does not parse is a :class:`ConfigError`.
    """
    kind = option_types(name).get(key) if name in MECHANISMS else None
    if kind is str:
        return text
    if kind is bool:
        if text.strip().lower() not in ("true", "false"):
            raise ConfigError(f"{param} {key}: option {key!r} of {name!r} is true or false, got "
                              f"{text!r}.")
        return text.strip().lower() == "true"
    try:
        number = float(text)
    except ValueError:
        number = None
    if kind is int:
        try:
            return int(text)
        except ValueError:
            pass
        if number is None or not math.isfinite(number) or not number.is_integer():
            raise ConfigError(f"{param} {key}: option {key!r} of {name!r} is an integer, got "
                              f"{text!r}.")
        return int(number)
    if kind is float:
        if number is None:
            raise ConfigError(f"{param} {key}: option {key!r} of {name!r} is a number, got "
                              f"{text!r}.")
        return number
    for cast in (int, float):  # undeclared: the most specific reading
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def check_mechanism(name: str, options: Iterable[str] = (), *, param: str | None = None) -> str:
    """Check a mechanism name and the names of its ``options`` without building it; return
    ``name``.  An unknown one is a :class:`ConfigError` (prefixed by ``param`` when given) that
    suggests the closest match.  Option values are checked when the mechanism is built."""
    where = f"{param}: " if param else ""
    if not isinstance(name, str):  # None, a number, a class: nothing to suggest a name from
        raise ConfigError(f"{where}a mechanism is named by a string, got {name!r} "
                          f"({type(name).__name__}). Choices: {', '.join(MECHANISMS)}.")
    if name not in MECHANISMS:
        raise ConfigError(f"{where}Unknown mechanism {name!r}.{did_you_mean(str(name), MECHANISMS)}"
                          f" Choices: {', '.join(MECHANISMS)}.")
    allowed = mechanism_options(name)
    for option in options:
        if option not in allowed:
            takes = f"Options: {', '.join(allowed)}." if allowed else "It takes no options."
            raise ConfigError(f"{where}Unknown option {option!r} for mechanism {name!r}."
                              f"{did_you_mean(option, allowed)} {takes}")
    return name


def build_mechanism(name: str, d_head: int, n_heads: int, **options) -> Mechanism:
    """Build mechanism ``name`` for heads of size ``d_head``; ``options`` are its own settings.

    An unknown name or an option the mechanism does not take is a :class:`ConfigError` that names
    it and suggests the closest match (:func:`check_mechanism`).
    """
    check_mechanism(name, options)
    return MECHANISMS[name](d_head, n_heads, **options)
