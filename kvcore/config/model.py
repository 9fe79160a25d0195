"""The configuration model: ``KVCoreConfig`` (everything kvcore needs to know that the engine does not tell
it) and ``PDConfig``, frozen attrs classes whose fields check themselves (``kvcore.kit.settings``). The
``backend`` field holds the settings of one backend kind, or a ``TierStack`` (``kvcore.config.tiers``);
reading a mapping into these is ``kvcore.config.loading``'s job, and finding a kind's settings class the
registry's (``kvcore.plugins.registry``): the model knows neither."""

from __future__ import annotations

from typing import Any

from attrs import Attribute, field, frozen
from attrs.validators import optional

from kvcore.keying.hashing import HashAlgorithm, PartialChunkPolicy
from kvcore.kit.settings import BackendSettings, BadValue, non_empty, one_of, seconds, within, word

__all__ = ["KVCoreConfig", "PDConfig"]


@frozen
class PDConfig:
    """Disaggregated prefill/decode over a peer transport (the role comes from the engine).

    The side channel (handshakes) listens on ``host:port`` (loopback by default; port 0 picks one, else
    1 to 65535). A producer frees a finished prefill's blocks once every consumer rank acknowledged them,
    or after ``abort_timeout_s``. Timeouts lie in [0.001, 86400] seconds, ``handshake_retries`` in
    [0, 1000]; ``devices`` may be empty.
    """

    host: str = field(default="127.0.0.1", validator=word("a host name or address (no spaces)"))
    port: int = field(
        default=0, validator=within(0, 65_535, "a TCP port from 1 to 65535, or 0 to pick a free one")
    )
    protocol: str = field(default="tcp", validator=one_of("tcp", "rdma"))
    devices: str = field(default="", validator=word("RDMA device names, comma-separated, or ''", r"\S*"))
    handshake_timeout_s: float = field(default=5.0, validator=seconds)
    handshake_retries: int = field(default=3, validator=within(0, 1000, "a count from 0 to 1000"))
    abort_timeout_s: float = field(default=120.0, validator=seconds)


def _checksummed(config: KVCoreConfig, attribute: Attribute[Any], value: bool) -> None:
    if value and config.backend.REMOTE:
        expected = (
            f"false with backend kind {config.backend.KIND!r} (checksums cover the local CPU tier only: "
            "a chunk from a remote tier carries no digest)"
        )
        raise BadValue(value, expected, attribute.name)


@frozen
class KVCoreConfig:
    """Everything kvcore needs to know that the engine does not tell it.

    ``chunk_tokens`` is at most 2**20 (more than any model's context); ``save_after_sightings`` at most
    2**20 too; the timeouts lie in [0.001, 86400] seconds. ``hash_seed`` and ``epoch`` are non-empty (they
    name what may be shared), ``secret`` is unset or non-empty. ``checksums`` needs the ``cpu`` backend.
    """

    backend: BackendSettings
    chunk_tokens: int = field(
        default=256, validator=within(1, 2**20, "a whole number of tokens from 1 to 2**20")
    )
    hash_algorithm: HashAlgorithm = HashAlgorithm.SHA256
    partial_chunks: PartialChunkPolicy = PartialChunkPolicy.KEEP
    eviction: str = field(default="lru", validator=one_of("lru", "arc"))
    save_after_sightings: int = field(default=1, validator=within(1, 2**20, "a count from 1 to 2**20"))
    lookup_timeout_s: float = field(default=1.0, validator=seconds)
    transfer_timeout_s: float = field(default=30.0, validator=seconds)
    hash_seed: str = field(default="kvcore", validator=non_empty)
    epoch: str = field(default="0", validator=non_empty)
    secret: str | None = field(default=None, repr=False, validator=optional(non_empty))
    checksums: bool = field(default=False, validator=_checksummed)
    pd: PDConfig | None = None
