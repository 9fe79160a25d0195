"""The host bytes of a ``StoreItem``: its ranges checked against the host buffer, and as views of it.

A store item names one range of the host buffer, or several runs one after another (one KV head's value
of a slot, ``StoreItem.runs``); a store that keeps values per head (``BackendSettings.PER_HEAD``) gathers
the runs on a put and scatters into them on a get, with ``views``: no copy where its I/O takes a list of
buffers (``pwritev``/``preadv``, Mooncake's multi-buffer transfers).
"""

from __future__ import annotations

from kvcore.errors import InvalidSpecError
from kvcore.ports import StoreItem

__all__ = ["check_ranges", "views"]


def check_ranges(i: int, item: StoreItem, buffer_length: int) -> None:
    """Raises ``InvalidSpecError`` naming ``items[i]`` unless each of its ranges is a non-empty range of
    the ``buffer_length``-byte host buffer and, for runs, they start at its ``offset`` and add up to its
    ``length``."""
    ranges = item.ranges()
    for offset, length in ranges:
        if offset < 0 or length < 1 or offset + length > buffer_length:
            raise InvalidSpecError(
                f"items[{i}] ({item.key!r}): bytes [{offset}, {offset + length}) are not "
                f"a non-empty range of the {buffer_length}-byte host buffer"
            )
    total = sum(length for _, length in ranges)
    if item.runs and (total != item.length or item.offset != ranges[0][0]):
        raise InvalidSpecError(
            f"items[{i}] ({item.key!r}): runs of {total} bytes from {ranges[0][0]}, "
            f"but offset {item.offset} and length {item.length}"
        )


def views(host: memoryview, item: StoreItem) -> list[memoryview]:
    """The item's ranges as views of ``host``, in value order."""
    return [host[offset : offset + length] for offset, length in item.ranges()]
