"""A rank's calls split into one per KV head (``kvcore_lmcache.heads``): each head's keys, chain and runs,
and a clear refusal of keys that do not join one key per head."""

from __future__ import annotations

import pytest

from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey
from kvcore.keying.keys import HEAD_SEPARATOR
from kvcore.model.head_runs import HeadRuns
from kvcore.ports import BlockItem, StoreItem
from kvcore_lmcache.heads import HeadSplit
from tests.hand_engine import engine_spec


def _joined(chunk: int, heads: int) -> ChunkKey:
    return ChunkKey(HEAD_SEPARATOR.join(f"kv/ns/l0-2.h{h}-{h + 1}.c0.g0/{chunk}" for h in range(heads)))


@pytest.fixture
def split() -> HeadSplit:
    runs = HeadRuns.of(engine_spec(1, kv_heads=2))
    assert runs is not None
    assert runs.heads == 2
    return HeadSplit(runs)


def test_each_head_gets_its_keys_chain_and_runs(split: HeadSplit) -> None:
    runs = split.runs
    chain = [_joined(c, 2) for c in range(3)]
    heads = split.chains(chain)
    assert heads == [tuple(key.split(HEAD_SEPARATOR)[h] for key in chain) for h in range(2)]
    items = [StoreItem(chain[1], 3 * runs.block_bytes, 2 * runs.block_bytes)]
    per_head = split.store_items(items)
    for head, (item,) in enumerate(per_head):
        assert item.key == heads[head][1]
        assert item.runs == runs.value(head, 3 * runs.block_bytes, 2)
        assert item.length == 2 * runs.head_bytes == sum(length for _, length in item.runs)
    blocks = split.block_items([BlockItem(chain[2], (7, 8), first=1, value_blocks=3)])
    assert [(b.key, b.engine_blocks, b.first, b.value_blocks) for (b,) in blocks] == [
        (heads[h][2], (7, 8), 1, 3) for h in range(2)
    ]


def test_keys_that_do_not_join_a_key_per_head_are_refused_by_name(split: HeadSplit) -> None:
    with pytest.raises(InvalidSpecError, match=r"chain\[1\] .*expected the keys of 2 KV heads joined"):
        split.chains([_joined(0, 2), _joined(1, 3)])
    with pytest.raises(InvalidSpecError, match=r"items\[0\] .*expected the keys of 2 KV heads joined"):
        split.block_items([BlockItem(_joined(0, 1), (1,))])
    with pytest.raises(InvalidSpecError, match=r"items\[0\] .*expected whole host blocks"):
        split.store_items([StoreItem(_joined(0, 2), 0, split.runs.block_bytes + 1)])
