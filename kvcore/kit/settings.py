"""The building blocks of a backend's config class: field types, validators, and the protocol the class
satisfies.

A backend distribution declares its config as a frozen attrs class (``BackendSettings``) whose fields use
these types and validators, so that every backend refuses bad input the same way: a ``ConfigError``
naming the field, the value and what was expected. ``kvcore.config`` structures the ``backend`` section of
a config through the class that the backend registry names for its ``kind``.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import reprlib
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any, ClassVar, NewType, Protocol

from attrs import Attribute, frozen

from kvcore.errors import ConfigError

__all__ = [
    "BackendSettings",
    "BadValue",
    "ByteCount",
    "ByteSize",
    "did_you_mean",
    "fits_in_memory",
    "format_size",
    "host_and_port",
    "keeps_heads",
    "non_empty",
    "one_of",
    "parse_size",
    "read_size",
    "seconds",
    "shown",
    "within",
    "word",
]


class BackendSettings(Protocol):
    """A backend's config class: a frozen attrs class whose fields are its keys under ``backend``.

    The class variables tell the core what it needs without knowing the backend: ``KIND`` is the value of
    ``backend.kind`` that selects it; ``HOST_FIELD`` names the field that sizes the host pool and
    ``host_bytes`` is that size in bytes, total across the ranks of one engine; ``MOVES_BLOCKS`` says the
    backend can work with no host pool (``host_bytes`` 0: its remote tier moves engine blocks itself);
    ``NODE_FIELDS`` name the fields whose bytes one node holds (summed, they must fit in its memory, see
    ``fits_in_memory``); ``REMOTE`` says chunks also live outside the engine (a store, a server): saves
    are staged through the pool and published, and chunks come back without the local tier's digests.

    One class variable is optional (``keeps_heads`` reads it): ``PER_HEAD = True`` says the backend's
    ``ChunkStore`` gathers and scatters ``StoreItem.runs``, so that it keeps one value per KV head, which
    engines at every tensor-parallel size share (``kvcore.keying.keys.HeadKeyspaces``). Without it a store is
    given one value per rank, shared only by engines of one TP size.
    """

    __attrs_attrs__: ClassVar[Any]
    KIND: ClassVar[str]
    HOST_FIELD: ClassVar[str]
    MOVES_BLOCKS: ClassVar[bool]
    NODE_FIELDS: ClassVar[tuple[str, ...]]
    REMOTE: ClassVar[bool]

    @property
    def host_bytes(self) -> int: ...


def keeps_heads(settings: object) -> bool:
    """Whether a backend's settings declare values per KV head (``BackendSettings``, ``PER_HEAD``)."""
    return getattr(type(settings), "PER_HEAD", False) is True


ByteSize = NewType("ByteSize", int)
ByteCount = NewType("ByteCount", int)  # like ByteSize, but 0 is allowed (e.g. "contribute nothing")

_UNITS = {
    "": 1,
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
"""Units, spelled exactly: ``GB`` is 10**9 bytes (SI), ``GiB`` is 2**30 (IEC). Any other spelling
(``gb``, ``GIB``, ``G``, ``Gi``) is refused rather than guessed: 10 GiB and 10 GB differ by 7 %."""
# ASCII digits only (int() would also take other scripts' digits), and few enough of them that no size
# string can reach Python's limit on integer conversions.
_SIZE = re.compile(r"\s*([0-9]{1,40}(?:\.[0-9]{1,40})?)\s*([A-Za-z]*)\s*")
_SIZE_LIMIT = 2**63
"""Sizes are below 2**63 bytes: every size ends up in a signed 64-bit integer somewhere (Mooncake, torch)."""


class _Brief(reprlib.Repr):
    """A ``repr`` that stays short and never raises: three levels deep, a few items per container, the
    first characters of a string, and no digits of an integer too long to print (``repr`` refuses one of
    more than 4300 digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = 60
        self.maxother = 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return super().repr_int(x, level)


_BRIEF = _Brief()


@frozen(repr=False)
class _Summary:
    """Stands in for a value in a ``ConfigError`` whose ``repr`` would be long, deep, or raise."""

    text: str

    def __repr__(self) -> str:
        return self.text


def shown(value: object) -> object:
    """``value`` itself when it prints short (``None``, a bool, a float, an integer of at most 128 bits,
    a string of at most 80 characters), else a ``_Summary`` of it: a ``ConfigError`` formats its value
    with ``repr``, which recurses on deep input and raises on huge integers."""
    if (
        value is None
        or isinstance(value, bool | float | _Summary)
        or (isinstance(value, int) and value.bit_length() <= 128)
        or (isinstance(value, str) and len(value) <= 80)
    ):
        return value
    return _Summary(_BRIEF.repr(value))


class BadValue(ConfigError):
    """A problem found by a structure hook (``field`` empty) or a validator (``field`` is the attribute).

    Built directly (``PDConfig(port=-1)``) a class raises it as the ``ConfigError`` it is; ``_load`` puts
    the path where it was found in front of ``field``. The value is kept as ``shown`` prints it.
    """

    def __init__(self, value: object, expected: str, field: str = "") -> None:
        super().__init__(field, shown(value), expected)


def did_you_mean(given: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``given`` (a typo of it), or ``""`` when none is
    close: appended to what a ``ConfigError`` expected."""
    if not isinstance(given, str):
        return ""
    close = difflib.get_close_matches(given, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_size(value: object, field_name: str = "size") -> int:
    """Bytes from an integer or a string like ``"8GiB"``, ``"1.5 GiB"``, ``"512MB"``, ``"4096"``; must be
    positive, a whole number of bytes, and below 2**63."""
    try:
        return read_size(value)
    except BadValue as exc:
        raise ConfigError(field_name, exc.value, exc.expected) from None


def read_size(value: object, *, allow_zero: bool = False) -> int:
    """Exact: a decimal string is read as a fraction, never through a float (``"9007199254740993"`` stays
    odd), and a size that is not a whole number of bytes (``"1.5B"``) is refused. Units are spelled
    exactly (``_UNITS``); a misspelt one is refused naming the spellings it may have meant."""
    expected = (
        f"a {'non-negative' if allow_zero else 'positive'} whole number of bytes below 2**63: an integer, "
        "or a string such as '8GiB' (8 * 2**30), '1.5 GiB' or '512MB' (512 * 10**6)"
    )
    if isinstance(value, bool):
        raise BadValue(value, expected)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        number, unit = m.groups()
        if unit not in _UNITS:
            raise BadValue(value, _misspelt(number, unit) or expected)
        exact = Fraction(number) * _UNITS[unit]
        if exact.denominator != 1:
            raise BadValue(value, expected)
        size = exact.numerator
    else:
        raise BadValue(value, expected)
    if not (0 if allow_zero else 1) <= size < _SIZE_LIMIT:
        raise BadValue(value, expected)
    return size


def _misspelt(number: str, unit: str) -> str:
    """What a size with a misspelt unit may have meant, for its error ("" for a unit that is no size's)."""
    key = unit.upper().removesuffix("B").removesuffix("I")
    if key not in ("K", "M", "G", "T"):
        return ""
    power = "KMGT".index(key) + 1
    return (
        f"a unit spelled exactly ({key}B is 10**{3 * power} bytes, {key}iB is 2**{10 * power}): did you "
        f"mean '{number}{key}iB' or '{number}{key}B'?"
    )


def within(low: float, high: float, expected: str) -> Callable[[object, Attribute[Any], float], None]:
    """Validator: ``low <= value <= high`` (NaN is in no range)."""

    def check(_: object, attribute: Attribute[Any], value: float) -> None:
        if not low <= value <= high:
            raise BadValue(value, expected, attribute.name)

    return check


seconds = within(0.001, 86_400.0, "seconds, from 0.001 (a millisecond) to 86400 (a day)")
"""Validator of every timeout and interval: a wait takes nothing longer than about 292 years (on ``inf``
it raises ``OverflowError``), a timeout beyond a day is a mistake, and one below a millisecond is zero."""


def one_of(*choices: str) -> Callable[[object, Attribute[Any], str], None]:
    def check(_: object, attribute: Attribute[Any], value: str) -> None:
        if value not in choices:
            raise BadValue(value, f"one of {', '.join(map(repr, choices))}", attribute.name)

    return check


def non_empty(_: object, attribute: Attribute[Any], value: str) -> None:
    if not value:
        raise BadValue(value, "a non-empty string", attribute.name)


def word(expected: str, pattern: str = r"\S+") -> Callable[[object, Attribute[Any], str], None]:
    """Validator of a string that goes to a socket or a native library: printable, matching ``pattern``
    (by default: one or more characters, none of them a space)."""
    shape = re.compile(pattern)

    def check(_: object, attribute: Attribute[Any], value: str) -> None:
        if not (value.isprintable() and shape.fullmatch(value)):
            raise BadValue(value, expected, attribute.name)

    return check


def host_and_port(_: object, attribute: Attribute[Any], value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not (
        sep
        and host
        and value.isprintable()
        and re.fullmatch(r"\S+", host)
        and re.fullmatch(r"[0-9]{1,5}", port)
        and 0 < int(port) < 65536
    ):
        raise BadValue(value, "'host:port' (a port from 1 to 65535)", attribute.name)


def _physical_memory() -> int | None:
    """This machine's physical memory in bytes; ``None`` where the platform does not tell."""
    try:
        page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None
    return page * pages if page > 0 and pages > 0 else None


def format_size(size: int) -> str:
    """``size`` bytes as a person reads it, in binary units to two decimals: ``"8 bytes"``, ``"1.5 KiB"``,
    ``"9.31 GiB"`` (what ``"10GB"`` is)."""
    for power, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if abs(size) >= 2**power:
            return f"{size / 2**power:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{size} byte{'s' * (size != 1)}"


def fits_in_memory(backend: BackendSettings, attribute: Attribute[Any], value: int) -> None:
    """Validator of each of a backend's ``NODE_FIELDS``: the host memory they ask of one node, summed,
    must fit in this machine's physical memory. The largest of them is named (the others pass), so one
    error names one field. No check where the platform does not tell its memory size."""
    physical = _physical_memory()
    sizes = {name: int(getattr(backend, name)) for name in backend.NODE_FIELDS}
    total = sum(sizes.values())
    if physical is None or total <= physical or max(sizes, key=sizes.__getitem__) != attribute.name:
        return
    held = (
        f"{' + '.join(sizes)} = {total} bytes ({format_size(total)}) on one node, " if len(sizes) > 1 else ""
    )
    expected = f"{held}at most this machine's physical memory: {physical} bytes ({format_size(physical)})"
    raise BadValue(value, expected, attribute.name)
