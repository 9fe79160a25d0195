"""Configuration: frozen attrs classes, one per backend chosen by a ``kind`` tag, read by a strict converter.

Unknown keys are refused, values are never coerced silently (``3.7`` is not an integer, ``"yes"`` is not a
boolean), and every problem is reported as ``ConfigError`` naming the field, the value and what was
expected. Sizes accept integers (bytes) or strings such as ``"8GiB"`` and ``"512MB"``. The core never reads
the environment: adapters hand in mappings (or a file path) and get a ``KVCoreConfig`` back.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import reprlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, NewType, NoReturn, TypeAlias, TypeVar

import cattrs
from attrs import Attribute, field, frozen
from attrs.validators import optional
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError
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


def _shown(value: object) -> object:
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


class _BadValue(ConfigError):
    """A problem found by a structure hook (``field`` empty) or a validator (``field`` is the attribute).

    Built directly (``PDConfig(port=-1)``) a class raises it as the ``ConfigError`` it is; ``_load`` puts
    the path where it was found in front of ``field``. The value is kept as ``_shown`` prints it.
    """

    def __init__(self, value: object, expected: str, field: str = "") -> None:
        super().__init__(field, _shown(value), expected)


def parse_size(value: object, field_name: str = "size") -> int:
    """Bytes from an integer or a string like ``"8GiB"``, ``"1.5 GiB"``, ``"512MB"``, ``"4096"``; must be
    positive, a whole number of bytes, and below 2**63."""
    try:
        return _parse_size(value)
    except _BadValue as exc:
        raise ConfigError(field_name, exc.value, exc.expected) from None


def _parse_size(value: object, *, allow_zero: bool = False) -> int:
    """Exact: a decimal string is read as a fraction, never through a float (``"9007199254740993"`` stays
    odd), and a size that is not a whole number of bytes (``"1.5B"``) is refused."""
    expected = (
        f"a {'non-negative' if allow_zero else 'positive'} whole number of bytes below 2**63: an integer, "
        "or a string such as '8GiB', '1.5 GiB' or '512MB'"
    )
    if isinstance(value, bool):
        raise _BadValue(value, expected)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)) and m.group(2).upper() in _UNITS:
        exact = Fraction(m.group(1)) * _UNITS[m.group(2).upper()]
        if exact.denominator != 1:
            raise _BadValue(value, expected)
        size = exact.numerator
    else:
        raise _BadValue(value, expected)
    if not (0 if allow_zero else 1) <= size < _SIZE_LIMIT:
        raise _BadValue(value, expected)
    return size


def _within(low: float, high: float, expected: str) -> Callable[[object, Attribute[Any], float], None]:
    """Validator: ``low <= value <= high`` (NaN is in no range)."""

    def check(_: object, attribute: Attribute[Any], value: float) -> None:
        if not low <= value <= high:
            raise _BadValue(value, expected, attribute.name)

    return check


_seconds = _within(0.001, 86_400.0, "seconds, from 0.001 (a millisecond) to 86400 (a day)")
"""Validator of every timeout and interval: a wait takes nothing longer than about 292 years (on ``inf``
it raises ``OverflowError``), a timeout beyond a day is a mistake, and one below a millisecond is zero."""


def _one_of(*choices: str) -> Callable[[object, Attribute[Any], str], None]:
    def check(_: object, attribute: Attribute[Any], value: str) -> None:
        if value not in choices:
            raise _BadValue(value, f"one of {', '.join(map(repr, choices))}", attribute.name)

    return check


def _non_empty(_: object, attribute: Attribute[Any], value: str) -> None:
    if not value:
        raise _BadValue(value, "a non-empty string", attribute.name)


def _word(expected: str, pattern: str = r"\S+") -> Callable[[object, Attribute[Any], str], None]:
    """Validator of a string that goes to a socket or a native library: printable, matching ``pattern``
    (by default: one or more characters, none of them a space)."""
    shape = re.compile(pattern)

    def check(_: object, attribute: Attribute[Any], value: str) -> None:
        if not (value.isprintable() and shape.fullmatch(value)):
            raise _BadValue(value, expected, attribute.name)

    return check


def _host_and_port(_: object, attribute: Attribute[Any], value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not (
        sep
        and host
        and value.isprintable()
        and re.fullmatch(r"\S+", host)
        and re.fullmatch(r"[0-9]{1,5}", port)
        and 0 < int(port) < 65536
    ):
        raise _BadValue(value, "'host:port' (a port from 1 to 65535)", attribute.name)


def _physical_memory() -> int | None:
    """This machine's physical memory in bytes; ``None`` where the platform does not tell."""
    try:
        page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None
    return page * pages if page > 0 and pages > 0 else None


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def _fits_in_memory(backend: BackendConfig, attribute: Attribute[Any], value: int) -> None:
    """Validator of each of a backend's ``NODE_FIELDS``: the host memory they ask of one node, summed,
    must fit in this machine's physical memory. The largest of them is named (the others pass), so one
    error names one field. No check where the platform does not tell its memory size."""
    physical = _physical_memory()
    sizes = {name: int(getattr(backend, name)) for name in backend.NODE_FIELDS}
    total = sum(sizes.values())
    if physical is None or total <= physical or max(sizes, key=sizes.__getitem__) != attribute.name:
        return
    held = f"{' + '.join(sizes)} = {total} bytes ({_gib(total)}) on one node, " if len(sizes) > 1 else ""
    expected = f"{held}at most this machine's physical memory: {physical} bytes ({_gib(physical)})"
    raise _BadValue(value, expected, attribute.name)


@frozen
class CPUBackendConfig:
    """The embedded default: a host-memory pool inside each worker, indexed by the scheduler.

    ``size`` is the total across all ranks of one engine, as vLLM's own offloading size is; it must fit in
    this machine's physical memory.
    """

    KIND: ClassVar[str] = "cpu"
    HOST_FIELD: ClassVar[str] = "size"
    DIRECT: ClassVar[bool] = False  # whether the backend can work with no host pool (host_bytes 0)
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("size",)  # host memory one node holds at least: their sum
    size: ByteSize = field(validator=_fits_in_memory)

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool, total across ranks."""
        return self.size


@frozen
class MooncakeStoreConfig:
    """A Mooncake distributed store shared by engine instances, in front of a local host tier.

    ``local_size`` is the host memory (total across ranks) that stages every transfer and keeps recent
    chunks, as the CPU backend's ``size``; ``segment_size`` is what each worker contributes to the shared
    pool (0: a pure client, the pool lives in segment holders), ``transfer_buffer_size`` each worker's
    staging buffer inside Mooncake. One node holds at least ``local_size + segment_size +
    transfer_buffer_size`` (more with several workers): that sum must fit in this machine's physical
    memory. ``master`` is ``host:port``; ``devices`` may be empty (no RDMA devices named); ``replicas``
    (copies of each chunk, each in another segment) is at most 1024; ``setup_timeout_s`` lies in
    [0.001, 86400] seconds.
    """

    KIND: ClassVar[str] = "mooncake_store"
    HOST_FIELD: ClassVar[str] = "local_size"
    DIRECT: ClassVar[bool] = False
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("local_size", "segment_size", "transfer_buffer_size")
    master: str = field(default="127.0.0.1:50051", validator=_host_and_port)
    metadata: str = field(
        default="P2PHANDSHAKE", validator=_word("'P2PHANDSHAKE' or a metadata server URL (no spaces)")
    )
    protocol: str = field(default="tcp", validator=_one_of("tcp", "rdma"))
    devices: str = field(default="", validator=_word("RDMA device names, comma-separated, or ''", r"\S*"))
    local_hostname: str = field(default="127.0.0.1", validator=_word("a host name or address (no spaces)"))
    local_size: ByteSize = field(default=ByteSize(2**30), validator=_fits_in_memory)
    segment_size: ByteCount = field(default=ByteCount(2**30), validator=_fits_in_memory)
    transfer_buffer_size: ByteSize = field(default=ByteSize(64 * 2**20), validator=_fits_in_memory)
    replicas: int = field(default=1, validator=_within(1, 1024, "a count from 1 to 1024"))
    setup_timeout_s: float = field(default=10.0, validator=_seconds)

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool (and staging), total across ranks."""
        return self.local_size


@frozen
class LMCacheMPConfig:
    """A standalone LMCache multiprocess server, driven by the engine through shared-memory slots.

    ``local_size`` 0 (the default): no local tier; the engine's blocks are copied straight into and out
    of the server's slots, whose memory is the node's host tier. A positive size keeps a host pool of the
    worker's in front of the server (hits there skip the server), through which every chunk is staged; it
    must fit in this machine's physical memory. ``url`` is a ZeroMQ endpoint (``tcp://host:port``,
    ``ipc://path``); the timeouts and the heartbeat lie in [0.001, 86400] seconds.
    """

    KIND: ClassVar[str] = "lmcache_mp"
    HOST_FIELD: ClassVar[str] = "local_size"
    DIRECT: ClassVar[bool] = True
    NODE_FIELDS: ClassVar[tuple[str, ...]] = ("local_size",)
    url: str = field(
        default="tcp://localhost:5555",
        validator=_word("a ZeroMQ endpoint such as 'tcp://localhost:5555'", r"[A-Za-z][A-Za-z0-9+.-]*://\S+"),
    )
    transfer_mode: str = field(default="engine_driven", validator=_one_of("engine_driven"))
    request_timeout_s: float = field(default=5.0, validator=_seconds)
    heartbeat_s: float = field(default=30.0, validator=_seconds)
    connect_timeout_s: float = field(default=1.0, validator=_seconds)
    local_size: ByteCount = field(default=ByteCount(0), validator=_fits_in_memory)

    @property
    def host_bytes(self) -> int:
        """Host memory for the local pool (and staging), total across ranks."""
        return self.local_size


BackendConfig: TypeAlias = CPUBackendConfig | MooncakeStoreConfig | LMCacheMPConfig
"""Every backend's config class; the ``kind`` key picks one."""

_BACKENDS: dict[str, type[BackendConfig]] = {
    cls.KIND: cls for cls in (CPUBackendConfig, MooncakeStoreConfig, LMCacheMPConfig)
}


@frozen
class PDConfig:
    """Disaggregated prefill/decode over a peer transport (the role comes from the engine).

    The side channel (handshakes) listens on ``host:port`` (loopback by default; port 0 picks one, else
    1 to 65535). A producer frees a finished prefill's blocks once every consumer rank acknowledged them,
    or after ``abort_timeout_s``. Timeouts lie in [0.001, 86400] seconds, ``handshake_retries`` in
    [0, 1000]; ``devices`` may be empty.
    """

    host: str = field(default="127.0.0.1", validator=_word("a host name or address (no spaces)"))
    port: int = field(
        default=0, validator=_within(0, 65_535, "a TCP port from 1 to 65535, or 0 to pick a free one")
    )
    protocol: str = field(default="tcp", validator=_one_of("tcp", "rdma"))
    devices: str = field(default="", validator=_word("RDMA device names, comma-separated, or ''", r"\S*"))
    handshake_timeout_s: float = field(default=5.0, validator=_seconds)
    handshake_retries: int = field(default=3, validator=_within(0, 1000, "a count from 0 to 1000"))
    abort_timeout_s: float = field(default=120.0, validator=_seconds)


def _checksummed(config: KVCoreConfig, attribute: Attribute[Any], value: bool) -> None:
    if value and not isinstance(config.backend, CPUBackendConfig):
        expected = (
            f"false with backend kind {config.backend.KIND!r} (checksums cover the local CPU tier only: "
            "a chunk from a remote tier carries no digest)"
        )
        raise _BadValue(value, expected, attribute.name)


@frozen
class KVCoreConfig:
    """Everything kvcore needs to know that the engine does not tell it.

    ``chunk_tokens`` is at most 2**20 (more than any model's context); ``save_after_sightings`` at most
    2**20 too; the timeouts lie in [0.001, 86400] seconds. ``hash_seed`` and ``epoch`` are non-empty (they
    name what may be shared), ``secret`` is unset or non-empty. ``checksums`` needs the ``cpu`` backend.
    """

    backend: BackendConfig
    chunk_tokens: int = field(
        default=256, validator=_within(1, 2**20, "a whole number of tokens from 1 to 2**20")
    )
    hash_algorithm: HashAlgorithm = HashAlgorithm.SHA256
    partial_chunks: PartialChunkPolicy = PartialChunkPolicy.DROP
    eviction: str = field(default="lru", validator=_one_of("lru", "arc"))
    save_after_sightings: int = field(default=1, validator=_within(1, 2**20, "a count from 1 to 2**20"))
    lookup_timeout_s: float = field(default=1.0, validator=_seconds)
    transfer_timeout_s: float = field(default=30.0, validator=_seconds)
    hash_seed: str = field(default="kvcore", validator=_non_empty)
    epoch: str = field(default="0", validator=_non_empty)
    secret: str | None = field(default=None, repr=False, validator=optional(_non_empty))
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


def _text(value: object, _: type[Any]) -> str:
    """A string that can be encoded: JSON can spell a lone surrogate (``"\\ud800"``), which no encoding
    takes, and every string here is encoded somewhere (a key, a socket, a native call)."""
    if not isinstance(value, str):
        raise _BadValue(value, "a string")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise _BadValue(value, "a string of Unicode text (no lone surrogates)") from None
    return value


def _float(value: object, _: type[Any]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _BadValue(value, "a number")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        raise _BadValue(value, "a finite number") from None
    if not math.isfinite(number):
        raise _BadValue(value, "a finite number")
    return number


def _enum(value: object, cls: type[enum.Enum]) -> enum.Enum:
    """The member whose value is ``value``, of the same type (``cls(value)`` would format a refused value
    with ``repr``, which recurses on deep input)."""
    for member in cls:
        if type(member.value) is type(value) and member.value == value:
            return member
    raise _BadValue(value, f"one of {', '.join(repr(m.value) for m in cls)}")


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(str, _text)
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
    kinds = f"one of {', '.join(map(repr, sorted(_BACKENDS)))}"

    def backend(value: object, _: type[Any]) -> BackendConfig:
        if not isinstance(value, Mapping):
            raise _BadValue(value, f"a mapping with a 'kind' key, {kinds}")
        kind = value.get("kind", "<missing>")
        if not isinstance(kind, str) or kind not in structurers:
            raise _BadValue(kind, kinds, "kind")
        rest = {k: v for k, v in value.items() if k != "kind"}
        config: BackendConfig = structurers[kind](rest, _BACKENDS[kind])
        return config

    structure_pd = make_dict_structure_fn(PDConfig, conv, _cattrs_forbid_extra_keys=True)

    def pd(value: object, _: type[Any]) -> PDConfig:
        if not isinstance(value, Mapping):
            raise _BadValue(value, "a mapping")
        return structure_pd(value, PDConfig)

    conv.register_structure_hook(BackendConfig, backend)
    conv.register_structure_hook(PDConfig, pd)
    conv.register_unstructure_hook(
        BackendConfig, lambda b: {"kind": b.KIND, **conv.unstructure_attrs_asdict(b)}
    )
    return conv


_CONVERTER = _make_converter()
_Loaded = TypeVar("_Loaded", KVCoreConfig, PDConfig)


def _key(key: object) -> str:
    """A mapping key as it appears in a path: a short string as it is, anything else as ``_shown``."""
    return key if isinstance(key, str) and len(key) <= 80 else repr(_shown(key))


def _problems(exc: BaseException, path: str) -> Iterator[tuple[str, object, str]]:
    """(field path, value, expected) for each problem in ``exc``; a problem with no path names
    ``config``, the whole mapping."""
    if isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            yield from _problems(sub, f"{path}.{note.name}" if path else note.name)
        for sub in without:
            yield from _problems(sub, path)
    elif isinstance(exc, ForbiddenExtraKeysError):
        for key in sorted(map(_key, exc.extra_fields)):
            yield (f"{path}.{key}" if path else key, "<unknown key>", "no such key")
    elif isinstance(exc, _BadValue):
        yield (".".join(p for p in (path, exc.field) if p) or "config", exc.value, exc.expected)
    elif isinstance(exc, KeyError):
        yield (path, "<missing>", "a value (this key is required)")
    else:  # a mapping that fails when read, or a bug: still a ConfigError, never a raw traceback
        yield (path or "config", "<unreadable>", f"a readable value ({type(exc).__name__})")


def load_config(data: Mapping[str, object]) -> KVCoreConfig:
    """Validate a mapping (parsed JSON, ``kv_connector_extra_config``) into a ``KVCoreConfig``.

    Raises ``ConfigError`` naming the first bad field; its message lists every problem found.
    """
    return _load(data, KVCoreConfig, "")


def load_pd_config(data: Mapping[str, object]) -> PDConfig:
    """Validate the ``pd`` section of a mapping alone (a P/D connector needs no tier backend); a missing
    section gives the defaults. Errors name ``pd.<field>``."""
    if not isinstance(data, Mapping):
        raise ConfigError("config", _shown(data), "a mapping")
    return _load(data.get("pd", {}), PDConfig, "pd")


def _load(data: object, cls: type[_Loaded], path: str) -> _Loaded:
    """Structure ``data`` as ``cls``; every failure, whatever raised it, becomes one ``ConfigError`` with
    a path (``path`` in front), and a note lists the other problems."""
    try:
        if not isinstance(data, Mapping):
            raise _BadValue(data, "a mapping")
        return _CONVERTER.structure(dict(data), cls)
    except Exception as exc:  # every failure of hostile input is reported, not raised
        problems = list(_problems(exc, path))
    first = problems[0]
    error = ConfigError(*first)
    if len(problems) > 1:
        error.add_note("also: " + "; ".join(f"{f}: got {v!r}, expected {e}" for f, v, e in problems[1:]))
    raise error


_FILE_BYTES = 2**20
"""A config file is at most 1 MiB: a real one is a few hundred bytes (and /dev/zero never ends)."""
_JSON_DIGITS = 100
"""Integers in a config file have at most 100 digits (a size below 2**63 has 19): a longer one is
refused as such, before Python's limit on integer conversions (4300 digits) raises a ValueError."""


class _NotJSON(ValueError):
    """What ``json`` accepts but kvcore does not: a duplicate key, NaN or Infinity, an endless integer."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) < len(pairs):
        twice = [key for key, count in Counter(key for key, _ in pairs).items() if count > 1]
        raise _NotJSON(f"the key {', '.join(map(repr, twice))} appears more than once in one object")
    return data


def _no_constant(name: str) -> NoReturn:
    raise _NotJSON(f"{name} is not a JSON number")


def _short_integer(text: str) -> int:
    if len(text.lstrip("-")) > _JSON_DIGITS:
        raise _NotJSON(f"an integer of {len(text.lstrip('-'))} digits is longer than any setting takes")
    return int(text)


def load_config_file(path: str | Path) -> KVCoreConfig:
    """Read a JSON config file (adapters that accept YAML parse it themselves and call ``load_config``).

    The file must be UTF-8 (a byte-order mark is skipped), at most 1 MiB, and hold one JSON object with no
    duplicate keys, no NaN or Infinity, and no integer of more than 100 digits; anything else is a
    ``ConfigError`` naming ``config_file``.
    """

    def refuse(expected: str) -> NoReturn:
        raise ConfigError("config_file", str(path), expected)

    try:
        with open(path, "rb") as file:
            raw = file.read(_FILE_BYTES + 1)
    except OSError as exc:
        refuse(f"a readable file ({exc.strerror or exc})")
    except ValueError:  # a NUL character in the path
        refuse("a file path")
    if len(raw) > _FILE_BYTES:
        refuse("a file of at most 1 MiB")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        refuse(f"UTF-8 text (byte {exc.start} is not)")
    if not text.strip():
        refuse("a JSON object (the file is empty)")
    try:
        data = json.loads(
            text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_int=_short_integer
        )
    except ValueError as exc:  # json.JSONDecodeError or _NotJSON
        refuse(f"valid JSON ({exc})")
    except RecursionError:
        refuse("valid JSON nested less deeply")
    if not isinstance(data, dict):
        refuse(f"a JSON object at the top level, not {_shown(data)!r}")
    return load_config(data)


def config_to_dict(config: KVCoreConfig) -> dict[str, Any]:
    """The resolved values, JSON-ready, with the secret masked."""
    data: dict[str, Any] = _CONVERTER.unstructure(config)
    if data.get("secret") is not None:
        data["secret"] = "***"
    return data
