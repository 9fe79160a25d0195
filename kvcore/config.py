"""Configuration: frozen attrs classes, one per backend chosen by a ``kind`` tag, read by a strict converter.

Unknown keys are refused, values are never coerced silently (``3.7`` is not an integer, ``"yes"`` is not a
boolean), and every problem is reported as ``ConfigError`` naming the field, the value and what was
expected. Sizes accept integers (bytes) or strings such as ``"8GiB"`` and ``"512MB"``. The core never reads
the environment: adapters hand in mappings (or a file path) and get a ``KVCoreConfig`` back.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, NewType, TypeAlias, TypeVar

import cattrs
from attrs import Attribute, field, frozen
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn

from kvcore.errors import ConfigError
from kvcore.hashing import HashAlgorithm, PartialChunkPolicy

__all__ = [
    "BackendConfig",
    "ByteCount",
    "ByteSize",
    "CPUBackendConfig",
    "KVCoreConfig",
    "LMCacheMPConfig",
    "MooncakeStoreConfig",
    "PDConfig",
    "config_to_dict",
    "load_config",
    "load_config_file",
    "load_pd_config",
    "parse_size",
]

ByteSize = NewType("ByteSize", int)
ByteCount = NewType("ByteCount", int)  # like ByteSize, but 0 is allowed (e.g. "contribute nothing")

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


class _BadValue(ValueError):
    """Raised inside the converter; turned into ``ConfigError`` with the field's path."""

    def __init__(self, value: object, expected: str, field: str = "") -> None:
        super().__init__(expected)
        self.value = value
        self.expected = expected
        self.field = field


def parse_size(value: object, field_name: str = "size") -> int:
    """Bytes from an integer or a string like ``"8GiB"``, ``"512MB"``, ``"4096"``; must be positive."""
    try:
        return _parse_size(value)
    except _BadValue as exc:
        raise ConfigError(field_name, value, exc.expected) from None


def _parse_size(value: object, *, allow_zero: bool = False) -> int:
    expected = (
        f"a {'non-negative' if allow_zero else 'positive'} size: bytes as an integer, "
        "or a string such as '8GiB' or '512MB'"
    )
    if isinstance(value, bool):
        raise _BadValue(value, expected)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)) and m.group(2).upper() in _UNITS:
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise _BadValue(value, expected)
    if size < 0 or (size == 0 and not allow_zero):
        raise _BadValue(value, expected)
    return size


def _positive(_: object, attribute: Attribute[Any], value: float) -> None:
    if value <= 0:
        raise _BadValue(value, "a number > 0", attribute.name)


@frozen
class CPUBackendConfig:
    """The embedded default: a host-memory pool inside each worker, indexed by the scheduler.

    ``size`` is the total across all ranks of one engine, as vLLM's own offloading size is.
    """

    KIND: ClassVar[str] = "cpu"
    HOST_FIELD: ClassVar[str] = "size"
    DIRECT: ClassVar[bool] = False  # whether the backend can work with no host pool (host_bytes 0)
    size: ByteSize

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool, total across ranks."""
        return self.size


def _one_of(*choices: str) -> Callable[[object, Attribute[Any], str], None]:
    def check(_: object, attribute: Attribute[Any], value: str) -> None:
        if value not in choices:
            raise _BadValue(value, f"one of {', '.join(map(repr, choices))}", attribute.name)

    return check


def _non_negative(_: object, attribute: Attribute[Any], value: float) -> None:
    if value < 0:
        raise _BadValue(value, "a number >= 0", attribute.name)


@frozen
class MooncakeStoreConfig:
    """A Mooncake distributed store shared by engine instances, in front of a local host tier.

    ``local_size`` is the host memory (total across ranks) that stages every transfer and keeps recent
    chunks, as the CPU backend's ``size``; ``segment_size`` is what each worker contributes to the shared
    pool (0: a pure client, the pool lives in segment holders).
    """

    KIND: ClassVar[str] = "mooncake_store"
    HOST_FIELD: ClassVar[str] = "local_size"
    DIRECT: ClassVar[bool] = False
    master: str = "127.0.0.1:50051"
    metadata: str = "P2PHANDSHAKE"
    protocol: str = field(default="tcp", validator=_one_of("tcp", "rdma"))
    devices: str = ""
    local_hostname: str = "127.0.0.1"
    local_size: ByteSize = ByteSize(2**30)
    segment_size: ByteCount = ByteCount(2**30)
    transfer_buffer_size: ByteSize = ByteSize(64 * 2**20)
    replicas: int = field(default=1, validator=_positive)
    setup_timeout_s: float = field(default=10.0, validator=_positive)

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool (and staging), total across ranks."""
        return self.local_size


@frozen
class LMCacheMPConfig:
    """A standalone LMCache multiprocess server, driven by the engine through shared-memory slots.

    ``local_size`` 0 (the default): no local tier; the engine's blocks are copied straight into and out
    of the server's slots, whose memory is the node's host tier. A positive size keeps a host pool of the
    worker's in front of the server (hits there skip the server), through which every chunk is staged.
    """

    KIND: ClassVar[str] = "lmcache_mp"
    HOST_FIELD: ClassVar[str] = "local_size"
    DIRECT: ClassVar[bool] = True
    url: str = "tcp://localhost:5555"
    transfer_mode: str = field(default="engine_driven", validator=_one_of("engine_driven"))
    request_timeout_s: float = field(default=5.0, validator=_positive)
    heartbeat_s: float = field(default=30.0, validator=_positive)
    connect_timeout_s: float = field(default=1.0, validator=_positive)
    local_size: ByteCount = ByteCount(0)

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool (and staging), total across ranks."""
        return self.local_size


BackendConfig: TypeAlias = CPUBackendConfig | MooncakeStoreConfig | LMCacheMPConfig
"""Every backend's config class; the ``kind`` key picks one."""

_BACKENDS: dict[str, type[BackendConfig]] = {
    cls.KIND: cls for cls in (CPUBackendConfig, MooncakeStoreConfig, LMCacheMPConfig)
}
_EVICTIONS = ("lru", "arc")


@frozen
class PDConfig:
    """Disaggregated prefill/decode over a peer transport (the role comes from the engine).

    The side channel (handshakes) listens on ``host:port`` (loopback by default; port 0 picks one).
    A producer frees a finished prefill's blocks once every consumer rank acknowledged them, or after
    ``abort_timeout_s``.
    """

    host: str = "127.0.0.1"
    port: int = field(default=0, validator=_non_negative)
    protocol: str = field(default="tcp", validator=_one_of("tcp", "rdma"))
    devices: str = ""
    handshake_timeout_s: float = field(default=5.0, validator=_positive)
    handshake_retries: int = field(default=3, validator=_non_negative)
    abort_timeout_s: float = field(default=120.0, validator=_positive)


def _eviction(_: object, attribute: Attribute[Any], value: str) -> None:
    if value not in _EVICTIONS:
        raise _BadValue(value, f"one of {', '.join(map(repr, _EVICTIONS))}", attribute.name)


def _checksummed(config: KVCoreConfig, attribute: Attribute[Any], value: bool) -> None:
    backend = config.backend
    if value and backend.DIRECT and backend.host_bytes == 0:
        expected = (
            f"false with no backend.{backend.HOST_FIELD} (checksums cover the host pool, and there is none)"
        )
        raise _BadValue(value, expected, attribute.name)


@frozen
class KVCoreConfig:
    """Everything kvcore needs to know that the engine does not tell it."""

    backend: BackendConfig
    chunk_tokens: int = field(default=256, validator=_positive)
    hash_algorithm: HashAlgorithm = HashAlgorithm.SHA256
    partial_chunks: PartialChunkPolicy = PartialChunkPolicy.DROP
    eviction: str = field(default="lru", validator=_eviction)
    save_after_sightings: int = field(default=1, validator=_positive)
    lookup_timeout_s: float = field(default=1.0, validator=_positive)
    transfer_timeout_s: float = field(default=30.0, validator=_positive)
    hash_seed: str = "kvcore"
    epoch: str = "0"
    secret: str | None = field(default=None, repr=False)
    checksums: bool = field(default=False, validator=_checksummed)
    pd: PDConfig | None = None


def _strict(kind: type[Any], expected: str) -> Callable[[object, type[Any]], Any]:
    def hook(value: object, _: type[Any]) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise _BadValue(value, expected)
        if not isinstance(value, kind):
            raise _BadValue(value, expected)
        return value

    return hook


def _float(value: object, _: type[Any]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _BadValue(value, "a number")
    return float(value)


def _enum(value: object, cls: type[enum.Enum]) -> enum.Enum:
    try:
        return cls(value)
    except ValueError:
        raise _BadValue(value, f"one of {', '.join(repr(m.value) for m in cls)}") from None


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(str, _strict(str, "a string"))
    conv.register_structure_hook(bool, _strict(bool, "true or false"))
    conv.register_structure_hook(float, _float)
    conv.register_structure_hook(ByteSize, lambda v, _: ByteSize(_parse_size(v)))
    conv.register_structure_hook(ByteCount, lambda v, _: ByteCount(_parse_size(v, allow_zero=True)))
    conv.register_structure_hook_func(lambda t: isinstance(t, type) and issubclass(t, enum.Enum), _enum)
    conv.register_unstructure_hook_func(
        lambda t: isinstance(t, type) and issubclass(t, enum.Enum), lambda e: e.value
    )

    # BackendConfig may be a single class: build each class's structurer directly, so that the tagged
    # hook below does not call itself.
    structurers = {
        kind: make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True)
        for kind, cls in _BACKENDS.items()
    }

    def backend(value: object, _: type[Any]) -> BackendConfig:
        if not isinstance(value, Mapping):
            raise _BadValue(value, "a mapping with a 'kind' key")
        kind = value.get("kind")
        if not isinstance(kind, str) or kind not in structurers:
            raise _BadValue(kind, f"'kind' one of {', '.join(map(repr, sorted(_BACKENDS)))}")
        rest = {k: v for k, v in value.items() if k != "kind"}
        config: BackendConfig = structurers[kind](rest, _BACKENDS[kind])
        return config

    conv.register_structure_hook(BackendConfig, backend)
    conv.register_unstructure_hook(
        BackendConfig, lambda b: {"kind": b.KIND, **conv.unstructure_attrs_asdict(b)}
    )
    return conv


_CONVERTER = _make_converter()
_Loaded = TypeVar("_Loaded", KVCoreConfig, PDConfig)


def _problems(exc: BaseException, path: str) -> Iterator[tuple[str, object, str]]:
    if isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            yield from _problems(sub, f"{path}.{note.name}" if path else note.name)
        for sub in without:
            yield from _problems(sub, path)
    elif isinstance(exc, IterableValidationError):
        inner, plain = exc.group_exceptions()
        for sub, inote in inner:
            yield from _problems(sub, f"{path}[{inote.index}]")
        for sub in plain:
            yield from _problems(sub, path)
    elif isinstance(exc, ForbiddenExtraKeysError):
        for key in sorted(exc.extra_fields):
            yield (f"{path}.{key}" if path else key, "<unknown key>", "no such key")
    elif isinstance(exc, _BadValue):
        yield (".".join(p for p in (path, exc.field) if p), exc.value, exc.expected)
    elif isinstance(exc, KeyError):
        yield (path, "<missing>", "a value (this key is required)")
    else:
        yield (path, "<invalid>", str(exc))


def load_config(data: Mapping[str, object]) -> KVCoreConfig:
    """Validate a mapping (parsed JSON, ``kv_connector_extra_config``) into a ``KVCoreConfig``.

    Raises ``ConfigError`` naming the first bad field; its message lists every problem found.
    """
    return _load(data, KVCoreConfig, "")


def load_pd_config(data: Mapping[str, object]) -> PDConfig:
    """Validate the ``pd`` section of a mapping alone (a P/D connector needs no tier backend); a missing
    section gives the defaults. Errors name ``pd.<field>``."""
    if not isinstance(data, Mapping):
        raise ConfigError("config", data, "a mapping")
    section = data.get("pd", {})
    if not isinstance(section, Mapping):
        raise ConfigError("pd", section, "a mapping")
    return _load(section, PDConfig, "pd")


def _load(data: Mapping[str, object], cls: type[_Loaded], path: str) -> _Loaded:
    if not isinstance(data, Mapping):
        raise ConfigError(path or "config", data, "a mapping")
    try:
        return _CONVERTER.structure(dict(data), cls)
    except (ClassValidationError, _BadValue) as exc:
        problems = list(_problems(exc, path))
        first = problems[0]
        error = ConfigError(*first)
        if len(problems) > 1:
            error.add_note("also: " + "; ".join(f"{f}: got {v!r}, expected {e}" for f, v, e in problems[1:]))
        raise error from None


def load_config_file(path: str | Path) -> KVCoreConfig:
    """Read a JSON config file (adapters that accept YAML parse it themselves and call ``load_config``)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("config_file", str(path), f"a readable file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError("config_file", str(path), f"valid JSON ({exc})") from None
    return load_config(data)


def config_to_dict(config: KVCoreConfig) -> dict[str, Any]:
    """The resolved values, JSON-ready, with the secret masked."""
    data: dict[str, Any] = _CONVERTER.unstructure(config)
    if data.get("secret") is not None:
        data["secret"] = "***"
    return data
