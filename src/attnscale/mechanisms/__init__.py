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
import numbers
import pkgutil
import typing
from collections.abc import Iterable, Mapping

from attnscale.errors import ConfigError, did_you_mean, parse_typed
from attnscale.mechanisms.base import MECHANISMS, Mechanism, register

# Explicit imports, in the order of the README's mechanism table; importing a module registers
# its mechanism.
from attnscale.mechanisms import scaled, unscaled, init_reparam, qknorm  # noqa: E402,F401
from attnscale.mechanisms import qk_layernorm, qk_rmsnorm, cosine, learned_temp  # noqa: E402,F401
from attnscale.mechanisms import mup, softcap, yarn, sigma_reparam, ssmax  # noqa: E402,F401
from attnscale.mechanisms import llama4_temp, qk_clip, logn, sink, sigmoid  # noqa: E402,F401
from attnscale.mechanisms import adaptive_temp, gated, clip_qkv  # noqa: E402,F401
from attnscale.mechanisms import softpick, stick_breaking, mscale  # noqa: E402,F401
from attnscale.mechanisms import forgetting, selective, differential  # noqa: E402,F401

# Then every other module of this folder (a new mechanism's file), sorted by name.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
del _module

__all__ = ["MECHANISMS", "Mechanism", "build_mechanism", "canonical_options", "check_mechanism",
           "defined_at_init", "mechanism_options", "option_types", "parse_option", "parse_options",
           "register"]


def defined_at_init() -> tuple[str, ...]:
    """The mechanisms whose temperature is a rule on q and k known at init (no trained weights),
    in registry order: those the Monte Carlo experiments can measure."""
    return tuple(name for name, cls in MECHANISMS.items() if cls.defined_at_init)


def mechanism_options(name: str) -> tuple[str, ...]:
    """The options ``name`` accepts: keyword-only arguments of its ``__init__``."""
    params = inspect.signature(MECHANISMS[name].__init__).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def option_types(name: str) -> dict[str, type]:
    """The type of each option ``name`` takes: its annotation (``cap: float``), else the type of
    its default."""
    init = MECHANISMS[name].__init__
    try:
        hints = typing.get_type_hints(init)
    except (NameError, TypeError):
        hints = {}
    params = inspect.signature(init).parameters
    return {k: hints.get(k, type(params[k].default)) for k in mechanism_options(name)}


def parse_options(items: Iterable[str], mechanism: str, param: str = "--option"
                  ) -> dict[str, object]:
    """``KEY=VALUE`` options of ``mechanism`` as a dict, each value read by the option's declared
    type (:func:`parse_option`: ``divisor=false`` is False); a key given twice is an error (the
    last would silently win)."""
    from attnscale.errors import split_key_value
    options: dict[str, object] = {}
    for text in items:
        key, value = split_key_value(param, text)
        if key in options:
            raise ConfigError(f"{param} sets {key!r} more than once; give each option once.")
        options[key] = parse_option(mechanism, key, value, param=param)
    return options


def parse_option(name: str, key: str, text: str, *, param: str = "--option") -> object:
    """The value of option ``key`` of mechanism ``name`` written as ``text`` (``KEY=VALUE`` on a
    command line, ``name(key=value)`` in a variant), read by the option's type
    (:func:`option_types`) with :func:`attnscale.errors.parse_typed`, the rule the sweep's
    ``--set`` and ``--grid`` read text by too: ``divisor=false`` is False, ``max_len=1e3`` is
    1000.  An option without a plain type (bool, int, float, str), or one the mechanism does not
    take (which :func:`check_mechanism` then reports), reads as an int, else a float, else the
    text.  A value that does not parse is a :class:`ConfigError` naming ``param`` and ``key``.
    """
    kind = option_types(name).get(key) if name in MECHANISMS else None
    if kind in (bool, int, float, str):
        return parse_typed(f"{param} {key}", text, kind)
    for cast in (int, float):  # no plain type: the most specific reading
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def canonical_options(names: str | Iterable[str], options: Mapping[str, object]) -> dict:
    """``options`` with each number in the one form its option's type gives it, so that equal
    settings are one: ``{"cap": 20}``, ``{"cap": 20.0}`` and ``{"cap": 2e1}`` are all
    ``{"cap": 20.0}`` for softcap, and an integral float is an int for an int option.  ``names``:
    the mechanism, or several (a grid's), an option being typed where those that take it agree.
    Unknown names, options and values are left as they are, for :func:`check_mechanism` and the
    mechanism to refuse."""
    names = [names] if isinstance(names, str) else list(names)
    types: dict[str, set] = {}
    for name in names:
        if isinstance(name, str) and name in MECHANISMS:
            for key, kind in option_types(name).items():
                types.setdefault(key, set()).add(kind)
    out = {}
    for key, value in options.items():
        kind = types.get(key, set())
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and len(kind) == 1:
            (kind,) = kind
            if kind is float:
                value = float(value)
            elif kind is int and isinstance(value, float) and value.is_integer():
                value = int(value)
        out[key] = value
    return out


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


def variant_text(mechanism: str, options: dict | None = None) -> str:
    """``softcap`` or ``softcap(cap=30)``: a mechanism and its options as one variant name."""
    if not options:
        return mechanism
    return mechanism + "(" + ", ".join(f"{k}={options[k]}" for k in sorted(options)) + ")"


def parse_variant(text: str, param: str = "mechanisms") -> tuple[str, dict]:
    """``"qk-layernorm(divisor=False)"`` -> ``("qk-layernorm", {"divisor": False})``: the inverse of
    ``variant_text``; values read as ``--option`` reads them, by each option's declared type.
    Errors name ``param``, where the text came from."""
    name, sep, rest = text.strip().partition("(")
    if sep and not rest.endswith(")"):
        raise ConfigError(f"{param}: mechanism variant {text!r} must look like "
                          "name(key=value, ...).")
    items = [p.strip() for p in rest[:-1].split(",") if p.strip()] if sep else []
    check_mechanism(name.strip(), param=param)
    options = parse_options(items, name.strip(), param=f"{param}: mechanism variant {text!r}")
    check_mechanism(name.strip(), options, param=param)
    return name.strip(), canonical_options(name.strip(), options)
