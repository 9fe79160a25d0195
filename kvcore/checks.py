"""Checks of what an engine hands to kvcore (block ids, token counts), before any of it reaches a copy.

A block id that is not an integer, lies outside the engine's KV tensors or appears twice in one request's
block table would make a copy read or write the wrong block: the saved chunk would then hold another
token's KV under a valid key, and every later hit would serve it. So every id is checked where it enters
(``CacheScheduler.save`` / ``start_load``, the ops' own fields), and a bad one is refused with a
``UsageError`` naming the argument — never truncated, never swallowed into a failed copy.

``None`` stands for a block the engine does not hold (a hole in its block table, e.g. a prefix block it
already evicted): chunks with a hole are never saved, and a load never writes one.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias, TypeGuard

from attrs import Attribute

from kvcore.errors import InvalidSpecError

__all__ = [
    "COUNT",
    "SIZE_LIMIT",
    "block_id",
    "check_block_table",
    "instance",
    "int_ids",
    "int_in",
    "int_tuple",
    "is_int_in",
    "positive_count",
    "text",
]

SIZE_LIMIT = 2**62
"""The largest count or byte size kvcore accepts: sums and products of such sizes that the backends form
(offsets, row indices) stay inside int64, so numpy and torch never overflow on them."""

COUNT = "an int in [1, 2**62]"
"""What ``positive_count`` expects, for messages that name it."""

Validator: TypeAlias = "Callable[[object, Attribute[Any], object], None]"


def is_int_in(value: object, low: int, high: int = SIZE_LIMIT) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` (a ``bool`` is not, nor a float of integral value) in ``[low, high]``.

    Takes ``object`` so that callers can check arguments typed ``int`` that may arrive as anything.
    """
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def int_in(low: int, high: int = SIZE_LIMIT) -> Validator:
    """An attrs validator for an int in ``[low, high]``: ``InvalidSpecError`` naming the class, the field
    and the value otherwise."""
    expected = f"an int in [{low}, {'2**62' if high == SIZE_LIMIT else high}]"

    def check(instance: object, attribute: Attribute[Any], value: object) -> None:
        if not is_int_in(value, low, high):
            raise InvalidSpecError(
                f"{type(instance).__name__}.{attribute.name}: got {value!r}, expected {expected}"
            )

    return check


positive_count = int_in(1)
"""attrs validator: the field is ``COUNT``."""


def instance(cls: type) -> Validator:
    """An attrs validator: an instance of ``cls`` (a bool is no int), else ``InvalidSpecError``."""

    def check(owner: object, attribute: Attribute[Any], value: object) -> None:
        if not isinstance(value, cls) or (isinstance(value, bool) and cls is not bool):
            raise InvalidSpecError(
                f"{type(owner).__name__}.{attribute.name}: got {value!r}, expected {cls.__name__}"
            )

    return check


def text(owner: object, attribute: Attribute[Any], value: object) -> None:
    """An attrs validator: a non-empty string, else ``InvalidSpecError`` naming the field."""
    if not isinstance(value, str) or not value:
        raise InvalidSpecError(
            f"{type(owner).__name__}.{attribute.name}: got {value!r}, expected a non-empty str"
        )


def block_id(name: str, value: object) -> int:
    """``value`` as a block id (an ``int`` or a NumPy integer; never a bool, float or string)."""
    if isinstance(value, bool):
        raise InvalidSpecError(f"{name}: got {value!r}, expected integer block ids")
    try:
        return operator.index(value)  # type: ignore[arg-type]  # refusing non-integers is the point
    except TypeError:
        raise InvalidSpecError(f"{name}: got {value!r}, expected integer block ids") from None


def check_block_table(name: str, values: object, num_blocks: int) -> tuple[int | None, ...]:
    """A request's block table, checked: integer ids in ``[0, num_blocks)`` or ``None`` (a hole), no id
    twice. Raises ``InvalidSpecError`` naming ``name``, the offending id and where it is."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | range):
        raise InvalidSpecError(f"{name}: got {values!r}, expected a sequence of block ids")
    table = tuple(None if value is None else block_id(name, value) for value in values)
    seen: set[int] = set()
    for position, block in enumerate(table):
        if block is None:
            continue
        if not 0 <= block < num_blocks:
            raise InvalidSpecError(
                f"{name}[{position}]: got block {block}, expected a block id in [0, {num_blocks})"
            )
        if block in seen:
            raise InvalidSpecError(
                f"{name}[{position}]: block {block} appears twice (one engine block cannot hold two blocks "
                "of a request)"
            )
        seen.add(block)
    return table


class _NotIds:
    """What ``int_tuple`` makes of a value that is not a collection of ids, for ``int_ids`` to refuse
    with the field's name (a converter does not know it)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    """Converter for integer-id fields: any iterable in, a tuple out (values stay hashable); pair it with
    the ``int_ids`` validator, which refuses what is not an integer id (a lone value, a string, None)."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        return (_NotIds(values),)  # type: ignore[return-value]  # int_ids refuses it, by name
    return tuple(values)


def int_ids(_: object, attribute: Attribute[tuple[int, ...]], value: tuple[int, ...]) -> None:
    """Validator of an integer-id field (after ``converter=tuple``): a bool, float or string among the
    ids is refused with ``InvalidSpecError`` naming the field, never truncated."""
    for item in value:
        block_id(attribute.name, item)
