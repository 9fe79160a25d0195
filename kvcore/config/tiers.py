"""A stack of tiers, configured as a list: ``{"tiers": [{"kind": "cpu", "size": "32GiB"}, {"kind": "disk",
...}, {"kind": "mooncake_store", ...}]}``.

The first tier is the local pool (a backend whose chunks live in the engine's host memory: not ``REMOTE``);
the ones after it are remote tiers (``REMOTE``), asked in order. ``TierStack`` is what
``KVCoreConfig.backend`` holds for such a config: it satisfies ``BackendSettings`` (its host memory is the
first tier's), and ``kvcore.plugins.compose`` opens each remote tier with a config whose ``backend`` is that
tier's own settings, so a backend never knows it is stacked. A stack of the pool and one remote tier is the
same thing as ``{"backend": <that remote tier>}`` with its host pool: one mechanism, the pool in front of a
remote tier; more remote tiers cascade behind it (``kvcore.scheduling.cascade_index``,
``kvcore.execution.cascade_remote``).

Each remote tier may carry ``admit_after``: the saves of a chunk this engine's rank must see before the
tier takes it (1, the default: every save; 2: only chunks saved twice, e.g. recomputed after every tier
before lost them, reach it), and ``write``: ``"through"`` (the default) writes each save to the tier at
once, side by side with the pool; ``"back"`` writes a chunk to it only when the pool is about to evict
the chunk (``CacheScheduler``: a chunk not yet written back is never evicted), or as the workers close
(``kvcore.pool.write_back``): saves cost the tier nothing until the pool needs room. A tier that moves engine
blocks itself (``MOVES_BLOCKS``, e.g. LMCache's) is written through only: it may address chunks by their
request's chain, which a write-back, long after the request, does not carry.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
from attrs import field, frozen

from kvcore.kit.settings import BackendSettings, BadValue, one_of, within

__all__ = ["TIER_KEYS", "Tier", "TierStack"]

TIER_KEYS: dict[str, type] = {"admit_after": int, "write": str}
"""The keys of a stacked tier that are the stack's, not its backend's, and their types."""


@frozen
class Tier:
    """One remote tier of a stack: its backend's settings, and its admission rule."""

    settings: BackendSettings
    admit_after: int = field(default=1, validator=within(1, 2**20, "a count of saves from 1 to 2**20"))
    write: str = field(default="through", validator=one_of("through", "back"))

    def __attrs_post_init__(self) -> None:
        if self.write == "back" and self.settings.MOVES_BLOCKS:
            raise BadValue(
                self.write,
                f"'through' for kind {self.settings.KIND!r} (a tier that moves engine blocks itself is "
                "written only along with its requests' saves, which name their chain)",
                "write",
            )

    @property
    def writes_back(self) -> bool:
        return self.write == "back"


def _remote_tiers(
    stack: TierStack, attribute: attrs.Attribute[tuple[Tier, ...]], value: tuple[Tier, ...]
) -> None:
    if not value:
        raise BadValue(len(value), "at least one remote tier after the first (the local pool)", "tiers")
    for i, tier in enumerate(value, start=1):
        if not tier.settings.REMOTE:
            raise BadValue(
                tier.settings.KIND,
                "a remote tier (only the first tier is the local pool)",
                f"tiers[{i}].kind",
            )


@frozen
class TierStack:
    """``BackendSettings`` for a list of tiers: ``local`` (the pool) and the ``remote`` tiers behind it."""

    KIND: ClassVar[str] = "tiers"
    HOST_FIELD: ClassVar[str] = "size"
    MOVES_BLOCKS: ClassVar[bool] = False
    REMOTE: ClassVar[bool] = True
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ()
    local: BackendSettings
    remote: tuple[Tier, ...] = field(validator=_remote_tiers)

    def __attrs_post_init__(self) -> None:
        if self.local.REMOTE or self.local.MOVES_BLOCKS:
            raise BadValue(self.local.KIND, "a local pool first (a tier that is not remote)", "tiers[0].kind")

    @property
    def writes_back(self) -> bool:
        """Whether any remote tier is written back (the pool then keeps chunks until they are)."""
        return any(tier.writes_back for tier in self.remote)

    @property
    def host_bytes(self) -> int:
        """The first tier's host memory: the pool in front of the others."""
        return self.local.host_bytes

    @property
    def host_field(self) -> str:
        """The key that sizes the pool, as the config spells it."""
        return f"tiers[0].{self.local.HOST_FIELD}"
