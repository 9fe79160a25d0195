"""A stack of tiers, configured as a list: ``{"tiers": [{"kind": "cpu", "size": "32GiB"}, {"kind": "disk",
...}, {"kind": "mooncake_store", ...}]}``.

The first tier is the local pool (a backend whose chunks live in the engine's host memory: not
``REMOTE``); the ones after it are remote tiers (``REMOTE``), asked in order. ``TierStack`` is what
``KVCoreConfig.backend`` holds for such a config: it satisfies ``BackendSettings`` (its host memory is the
first tier's), and ``kvcore.compose`` opens each remote tier with a config whose ``backend`` is that
tier's own settings, so a backend never knows it is stacked. A stack of the pool and
one remote tier is the same thing as ``{"backend": <that remote tier>}`` with its host pool: one
mechanism, the pool in front of a remote tier; more remote tiers cascade behind it (``kvcore.cascade``).

Each remote tier may carry ``admit_after``: the saves of a chunk this engine's rank must see before the
tier takes it (1, the default: every save; 2: only chunks saved twice, e.g. recomputed after every tier
before lost them, reach it). Saves are written through to every tier that admits them.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
from attrs import field, frozen

from kvcore.config_fields import BackendSettings, BadValue, within

__all__ = ["TIER_KEYS", "Tier", "TierStack"]

TIER_KEYS = ("admit_after",)
"""The keys of a stacked tier that are the stack's, not its backend's."""


@frozen
class Tier:
    """One remote tier of a stack: its backend's settings, and its admission rule."""

    settings: BackendSettings
    admit_after: int = field(default=1, validator=within(1, 2**20, "a count of saves from 1 to 2**20"))


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
    DIRECT: ClassVar[bool] = False
    REMOTE: ClassVar[bool] = True
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ()
    local: BackendSettings
    remote: tuple[Tier, ...] = field(validator=_remote_tiers)

    def __attrs_post_init__(self) -> None:
        if self.local.REMOTE or self.local.DIRECT:
            raise BadValue(self.local.KIND, "a local pool first (a tier that is not remote)", "tiers[0].kind")

    @property
    def host_bytes(self) -> int:
        """The first tier's host memory: the pool in front of the others."""
        return self.local.host_bytes

    @property
    def host_field(self) -> str:
        """The key that sizes the pool, as the config spells it."""
        return f"tiers[0].{self.local.HOST_FIELD}"
