"""A config in one line, for the start-up log of every process that runs kvcore: the tiers with their
sizes as given and as resolved, where each keeps its chunks (and whether a value per KV head, which
engines of every TP size share), the chunk size and how saves are written, and P/D where it is on.

Sizes are printed in binary units; where the config spelled a size otherwise, the spelling comes first
(``size 10GB = 9.31 GiB``), so that a person sees what a unit meant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from kvcore.config.model import KVCoreConfig
from kvcore.config.tiers import Tier, TierStack
from kvcore.kit.settings import BackendSettings, ByteCount, ByteSize, format_size, keeps_heads

__all__ = ["describe"]

_WHERE = ("path", "master", "url")
"""The fields that say where a tier keeps its chunks, shown when a backend has them."""
_SIZES: tuple[object, ...] = (ByteSize, ByteCount, "ByteSize", "ByteCount")
"""A size field's type: the class, or its name before attrs resolved it."""


def describe(
    config: KVCoreConfig, given: Mapping[str, object] | None = None, *, heads_split: bool = True
) -> str:
    """``config`` in one line; ``given`` is the mapping it was read from, whose size spellings are shown
    beside the sizes they resolved to. ``heads_split``: whether the engine's KV heads can be cut apart
    (``kvcore.model.head_runs.splits``; unknown before an engine runs): where not, a tier that keeps
    a value per KV head keeps one per rank, shared by engines of the same TP size."""
    raw = given or {}
    stack = config.backend
    if isinstance(stack, TierStack):
        spelled = raw.get("tiers")
        raws = list(spelled) if isinstance(spelled, Sequence) and not isinstance(spelled, str) else []
        tiers = [_tier(stack.local, _at(raws, 0), heads_split)] + [
            _tier(t.settings, _at(raws, n), heads_split, t) for n, t in enumerate(stack.remote, 1)
        ]
    else:
        backend = raw.get("backend")
        tiers = [_tier(stack, backend if isinstance(backend, Mapping) else {}, heads_split)]
    partial = "kept" if config.partial_chunks.value == "keep" else "dropped"
    secret = ", keys keyed by a secret" if config.secret else ""
    pd = config.pd
    beside = ""
    if pd is not None:
        port = pd.port or "a free port"
        beside = f"; P/D beside the tiers over {pd.protocol}, side channel {pd.host}:{port}"
    return (
        f"tiers: {' -> '.join(tiers)}; chunks of {config.chunk_tokens} tokens (partial chunks {partial}), "
        f"eviction {config.eviction}, epoch {config.epoch!r}{secret}{beside}"
    )


def _at(raws: list[object], n: int) -> Mapping[str, object]:
    value = raws[n] if n < len(raws) else None
    return value if isinstance(value, Mapping) else {}


def _tier(
    settings: BackendSettings, raw: Mapping[str, object], heads_split: bool, tier: Tier | None = None
) -> str:
    fields = attrs.fields(type(settings))
    where = [str(getattr(settings, f.name)) for f in fields if f.name in _WHERE]
    sizes = [
        _size(f.name, int(getattr(settings, f.name)), raw.get(f.name))
        for f in fields
        if f.type in _SIZES
        and (getattr(settings, f.name) or f.name in raw)
        and (tier is None or f.name != settings.HOST_FIELD)  # a stacked tier stages through the first's pool
    ]
    rule = ""
    if keeps_heads(settings):
        rule = ", a value per KV head (any TP size)"
        if not heads_split:
            rule = ", a value per rank (heads not cut apart)"
    if tier is not None:
        rule += f", written {tier.write}" + (
            f", admitted after {tier.admit_after} saves" if tier.admit_after > 1 else ""
        )
    return f"{settings.KIND}{' ' + where[0] if where else ''} ({', '.join(sizes) or 'no host memory'}{rule})"


def _size(name: str, size: int, spelled: object) -> str:
    resolved = format_size(size)
    if isinstance(spelled, str) and spelled.replace(" ", "") != resolved.replace(" ", ""):
        return f"{name} {spelled} = {resolved}"
    return f"{name} {resolved}"
