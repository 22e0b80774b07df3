"""Input validation shared by the API and the CLI.

Every check raises :class:`ConfigError`, a ``ValueError`` whose message is one line that names the
offending parameter.  The CLI turns exactly this exception into ``attnscale: error: ...`` and exit
code 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeVar


class ConfigError(ValueError):
    """Bad user input (an API argument or a CLI option)."""


# Whether the running call came from the command line: an error then names an option as the
# CLI spells it (--force), else as the Python API does (force=True).  Context-local.
_COMMAND_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar("attnscale_command_line",
                                                                     default=False)


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Run the block as the command line: :func:`spelled` gives the CLI's spelling inside it.
    ``attnscale``'s ``main`` runs every command in it."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def spelled(flag: str, keyword: str) -> str:
    """An option as the interface that raised the error spells it: ``flag`` (``--force``) on
    the command line, ``keyword`` (``force=True``) from Python."""
    return flag if _COMMAND_LINE.get() else keyword


T = TypeVar("T")


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean: x?"`` for the closest choice, or ``""`` when none is close."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
    return f" Did you mean: {close[0]}?" if close else ""


def lookup(table: Mapping[str, T], name: str, kind: str, plural: str) -> T:
    """``table[name]``; an unknown name is a :class:`ConfigError` that suggests the closest entry
    and lists them all: "Unknown {kind} 'x'. Did you mean: y? {plural}: a, b."."""
    if name not in table:
        raise ConfigError(f"Unknown {kind} {name!r}.{did_you_mean(name, table)} "
                          f"{plural}: {', '.join(table)}.")
    return table[name]


def check_choice(param: str, value: str, choices: Sequence[str], what: str | None = None) -> str:
    """Require ``value`` to be one of ``choices``; the error suggests the nearest one.

    ``what`` names the kind of thing chosen when it differs from the parameter, e.g.
    ``check_choice("--mechanisms", name, MECHANISMS, "mechanism")``.
    """
    if value not in choices:
        hint = did_you_mean(str(value), [str(c) for c in choices])
        listed = ", ".join(map(str, choices))
        if what is None:
            raise ConfigError(f"{param} must be one of {listed}; got {value!r}.{hint}")
        raise ConfigError(f"{param}: unknown {what} {value!r}.{hint} Choices: {listed}.")
    return value


def check_int(param: str, value: object, minimum: int | None = None) -> int:
    """Require an integer (bools excluded) that is at least ``minimum``."""
    if isinstance(value, bool):
        raise ConfigError(f"{param} must be an integer, got {value!r}.")
    if not isinstance(value, int):
        try:
            as_int = int(value)  # accepts numpy integers and integral strings
        except (TypeError, ValueError):
            raise ConfigError(f"{param} must be an integer, got {value!r}.") from None
        if isinstance(value, float) and value != as_int:
            raise ConfigError(f"{param} must be an integer, got {value!r}.")
        value = as_int
    if minimum is not None and value < minimum:
        raise ConfigError(f"{param} must be >= {minimum}, got {value}.")
    return value


def check_float(param: str, value: object, *, positive: bool = False) -> float:
    """Require a finite float (bools excluded), optionally > 0."""
    if isinstance(value, bool):
        raise ConfigError(f"{param} must be a number, got {value!r}.")
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{param} must be a number, got {value!r}.") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise ConfigError(f"{param} must be finite, got {value!r}.")
    if positive and out <= 0:
        raise ConfigError(f"{param} must be > 0, got {value!r}.")
    return out


# CLI words for a boolean (any case): the one spelling every command reads.
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "1"), ("false", "no", "0")


def parse_typed(param: str, text: str, kind: type) -> object:
    """CLI text as a value of the declared type ``kind``: bool (:data:`TRUE_WORDS` or
    :data:`FALSE_WORDS`), int (an integer, or a number with an integral value: ``1e3`` is 1000,
    as JSON's ``1e3`` is), float (a finite number) or str (the text as given).  Anything else is a
    one-line :class:`ConfigError` naming ``param`` and the type."""
    if kind is str:
        return text
    word = text.strip().lower()
    if kind is bool:
        if word in TRUE_WORDS + FALSE_WORDS:
            return word in TRUE_WORDS
        raise ConfigError(f"{param} must be true or false, got {text!r}.")
    if kind not in (int, float):
        raise TypeError(f"parse_typed: no text form for {kind!r}")
    try:
        number = float(word)
    except ValueError:
        number = None
    if number is None or number != number or number in (float("inf"), float("-inf")):
        what = "an integer" if kind is int else "a finite number"
        raise ConfigError(f"{param} must be {what}, got {text!r}.")
    if kind is float:
        return number
    if word.lstrip("+-").isdigit():
        return int(word)  # exact beyond 2^53
    if not number.is_integer():
        raise ConfigError(f"{param} must be an integer, got {text!r}.")
    return int(number)


def check_int_list(param: str, values: object, minimum: int | None = None) -> list[int]:
    """Require a non-empty sequence of integers, each at least ``minimum``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ConfigError(f"{param} must be a list of integers, got {values!r}.")
    out = [check_int(param, v, minimum) for v in values]
    if not out:
        raise ConfigError(f"{param} must not be empty.")
    return check_unique(param, out)


def check_int_or_list(param: str, values: object, minimum: int | None = None) -> list[int]:
    """An int or a non-empty list of distinct ints (as :func:`check_int_list`), as a list."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        return [check_int(param, values, minimum)]
    return check_int_list(param, values, minimum)


def check_unique(param: str, values: Sequence) -> list:
    """Require every entry of a list to be distinct: a repeated entry would merge two requests
    into one statistic (or count one run twice), so it is an error, never deduplicated."""
    seen: set = set()
    for v in values:
        if v in seen:
            raise ConfigError(f"{param} lists {v!r} more than once; each entry must be distinct.")
        seen.add(v)
    return list(values)


def check_name_list(param: str, values: object) -> list[str]:
    """Require a non-empty list of distinct, non-empty strings (a single string is refused)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ConfigError(f"{param} must be a list of names, got {values!r}.")
    out = list(values)
    if not out:
        raise ConfigError(f"{param} must not be empty.")
    for v in out:
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{param} must hold non-empty names, got {v!r}.")
    return check_unique(param, out)


def parse_int_list(param: str, text: str, minimum: int | None = None) -> list[int]:
    """Parse a comma-separated CLI list such as ``"4,16,64"``."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ConfigError(f"{param} must be a comma-separated list of integers, got {text!r}.")
    try:
        ints = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(
            f"{param} must be a comma-separated list of integers, got {text!r}."
        ) from None
    return check_int_list(param, ints, minimum)


def split_key_value(param: str, text: str) -> tuple[str, str]:
    """Split a CLI ``KEY=VALUE`` item into its stripped key and its value text."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{param} must look like key=value, got {text!r}.")
    return key, value


def parse_name_list(param: str, text: str) -> list[str]:
    """Parse a comma-separated CLI list of names such as ``"scaled,unscaled"``."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ConfigError(f"{param} must be a comma-separated list of names, got {text!r}.")
    return check_unique(param, parts)


def _distinct_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` that refuses a key given twice in one JSON object (``json.loads``
    would keep the last one silently)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(f"key {key!r} is given twice in one object")
        self.key = key


def parse_json(param: str, text: str | bytes, what: str = "JSON") -> object:
    """JSON text from a user (a CLI value, a file they wrote) as Python values.  Text that is not
    JSON (``what`` says what was expected), or an object that gives a key twice
    (``{"cap": 20, "cap": 30}``), is a ConfigError naming ``param``."""
    try:
        return json.loads(text, object_pairs_hook=_distinct_keys)
    except _DuplicateKey as err:
        raise ConfigError(f"{param}: {err}; give each key once.") from None
    except ValueError as err:
        raise ConfigError(f"{param} must be {what} ({err}).") from None
