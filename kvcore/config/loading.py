"""Reading a configuration: mappings (or a JSON file) into the frozen classes of ``kvcore.config.model``, by
a strict converter; the ``backend`` section is structured by the config class of the backend its ``kind``
names (``kvcore.plugins.registry``), which its distribution owns.

Unknown keys are refused, values are never coerced silently (``3.7`` is not an integer, ``"yes"`` is not a
boolean), and every problem is reported as ``ConfigError`` naming the field, the value and what was
expected. Sizes accept integers (bytes) or strings such as ``"8GiB"`` and ``"512MB"``. The core never reads
the environment: adapters hand in mappings (or a file path) and get a ``KVCoreConfig`` back.
"""

from __future__ import annotations

import enum
import json
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import attrs
import cattrs
from attrs import frozen
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn

from kvcore.config.model import KVCoreConfig, PDConfig
from kvcore.config.tiers import TIER_KEYS, Tier, TierStack
from kvcore.errors import ConfigError
from kvcore.kit.settings import (
    BackendSettings,
    BadValue,
    ByteCount,
    ByteSize,
    did_you_mean,
    read_size,
    shown,
)
from kvcore.plugins import registry

__all__ = [
    "config_to_dict",
    "load_config",
    "load_config_file",
    "load_pd_config",
    "read_config_file",
    "read_config_text",
]


@frozen
class _Stacked:
    """The ``tiers`` list of a config, handed to the ``backend`` hook (JSON can spell no such value)."""

    tiers: object


def _strict(kind: type[Any], expected: str) -> Callable[[object, type[Any]], Any]:
    def hook(value: object, _: type[Any]) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise BadValue(value, expected)
        if not isinstance(value, kind):
            raise BadValue(value, expected)
        return value

    return hook


def _text(value: object, _: type[Any]) -> str:
    """A string that can be encoded: JSON can spell a lone surrogate (``"\\ud800"``), which no encoding
    takes, and every string here is encoded somewhere (a key, a socket, a native call)."""
    if not isinstance(value, str):
        raise BadValue(value, "a string")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise BadValue(value, "a string of Unicode text (no lone surrogates)") from None
    return value


def _float(value: object, _: type[Any]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadValue(value, "a number")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        raise BadValue(value, "a finite number") from None
    if not math.isfinite(number):
        raise BadValue(value, "a finite number")
    return number


def _enum(value: object, cls: type[enum.Enum]) -> enum.Enum:
    """The member whose value is ``value``, of the same type (``cls(value)`` would format a refused value
    with ``repr``, which recurses on deep input)."""
    for member in cls:
        if type(member.value) is type(value) and member.value == value:
            return member
    raise BadValue(value, f"one of {', '.join(repr(m.value) for m in cls)}")


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(str, _text)
    conv.register_structure_hook(bool, _strict(bool, "true or false"))
    conv.register_structure_hook(float, _float)
    conv.register_structure_hook(ByteSize, lambda v, _: ByteSize(read_size(v)))
    conv.register_structure_hook(ByteCount, lambda v, _: ByteCount(read_size(v, allow_zero=True)))
    conv.register_structure_hook_func(lambda t: isinstance(t, type) and issubclass(t, enum.Enum), _enum)
    conv.register_unstructure_hook_func(
        lambda t: isinstance(t, type) and issubclass(t, enum.Enum), lambda e: e.value
    )

    structurers: dict[type[Any], Callable[[Mapping[str, Any], Any], Any]] = {}

    def backend(value: object, _: type[Any]) -> BackendSettings:
        if isinstance(value, _Stacked):
            return stack(value.tiers)
        if not isinstance(value, Mapping):
            raise BadValue(value, f"a mapping with a 'kind' key, {registry.expected_kinds()}")
        kind = value.get("kind", "<missing>")
        found = registry.backends()
        if not isinstance(kind, str) or kind not in found:
            raise BadValue(kind, registry.expected_kinds(kind), "kind")
        cls = found[kind].config_class
        if cls not in structurers:  # built directly: the hook for BackendSettings must not call itself
            structurers[cls] = make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True)
        config: BackendSettings = structurers[cls]({k: v for k, v in value.items() if k != "kind"}, cls)
        return config

    def tier(value: object, path: str) -> tuple[BackendSettings, dict[str, Any]]:
        """One tier of a stack: its backend's settings, and the stack's own keys of it (``TIER_KEYS``);
        a problem is raised as one ``BadValue`` whose field is its path from ``tiers``."""
        try:
            if not isinstance(value, Mapping):
                raise BadValue(value, f"a mapping with a 'kind' key, {registry.expected_kinds()}")
            own: dict[str, Any] = {}
            for key, kind in TIER_KEYS.items():
                if key in value:
                    try:
                        own[key] = conv.structure(value[key], kind)
                    except BadValue as exc:
                        raise BadValue(exc.value, exc.expected, key) from None
            return backend({k: v for k, v in value.items() if k not in TIER_KEYS}, BackendSettings), own
        except Exception as exc:  # the first problem, with its path under the tier
            field, got, expected = next(_problems(exc, path))
            raise BadValue(got, expected, field) from None

    def stack(tiers: object) -> TierStack:
        if not isinstance(tiers, Sequence) or isinstance(tiers, str | bytes) or len(tiers) < 2:
            raise BadValue(tiers, "a list of at least two tiers: the local pool, then remote tiers")
        local, extra = tier(tiers[0], "tiers[0]")
        if extra:
            key = sorted(extra)[0]
            raise BadValue(
                "<unknown key>", "no such key (the local pool takes every save)", f"tiers[0].{key}"
            )
        remote = []
        for i, value in enumerate(tiers[1:], start=1):
            settings, own = tier(value, f"tiers[{i}]")
            try:
                remote.append(Tier(settings, **own))
            except BadValue as exc:
                raise BadValue(exc.value, exc.expected, f"tiers[{i}].{exc.field}") from None
        return TierStack(local, tuple(remote))

    structure_pd = make_dict_structure_fn(PDConfig, conv, _cattrs_forbid_extra_keys=True)

    def pd(value: object, _: type[Any]) -> PDConfig:
        if not isinstance(value, Mapping):
            raise BadValue(value, "a mapping")
        return structure_pd(value, PDConfig)

    conv.register_structure_hook_func(lambda t: t is BackendSettings, backend)
    conv.register_structure_hook(PDConfig, pd)
    conv.register_unstructure_hook_func(
        lambda t: t is BackendSettings, lambda b: {"kind": b.KIND, **conv.unstructure_attrs_asdict(b)}
    )
    return conv


_CONVERTER = _make_converter()
_Loaded = TypeVar("_Loaded", KVCoreConfig, PDConfig)


def _key(key: object) -> str:
    """A mapping key as it appears in a path: a short string as it is, anything else as ``shown``."""
    return key if isinstance(key, str) and len(key) <= 80 else repr(shown(key))


def _problems(
    exc: BaseException, path: str, beside: Collection[str] = ()
) -> Iterator[tuple[str, object, str]]:
    """(field path, value, expected) for each problem in ``exc``; a problem with no path names
    ``config``, the whole mapping. An unknown key is told the known key it is closest to, ``beside``
    (keys a caller took out of the top-level mapping before) included."""
    if isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            yield from _problems(sub, f"{path}.{note.name}" if path else note.name)
        for sub in without:
            yield from _problems(sub, path, beside)
    elif isinstance(exc, ForbiddenExtraKeysError):
        known = [field.name for field in attrs.fields(exc.cl)] + list(beside if not path else ())
        if exc.cl is KVCoreConfig:
            known.append("tiers")
        for key in sorted(map(_key, exc.extra_fields)):
            yield (
                f"{path}.{key}" if path else key,
                "<unknown key>",
                "no such key" + did_you_mean(key, known),
            )
    elif isinstance(exc, BadValue):
        yield (".".join(p for p in (path, exc.field) if p) or "config", exc.value, exc.expected)
    elif isinstance(exc, KeyError):
        yield (path, "<missing>", "a value (this key is required)")
    else:  # a mapping that fails when read, or a bug: still a ConfigError, never a raw traceback
        yield (path or "config", "<unreadable>", f"a readable value ({type(exc).__name__})")


def load_config(data: Mapping[str, object], *, beside: Collection[str] = ()) -> KVCoreConfig:
    """Validate a mapping (parsed JSON, ``kv_connector_extra_config``) into a ``KVCoreConfig``.

    The tiers are given either as ``backend`` (one backend, with its host pool) or as ``tiers``, a list
    (``kvcore.config.tiers``): then ``backend`` holds their ``TierStack``. Raises ``ConfigError`` naming the
    first bad field; its message lists every problem found, and an unknown key the key it is closest to
    (``beside``: an engine adapter's own top-level keys, taken out before, are candidates too).
    """
    given: object = data  # typed a mapping, but hostile input may be anything: ``_load`` refuses it
    try:
        stacked = isinstance(given, Mapping) and "tiers" in given
    except Exception:  # a mapping that fails when read: ``_load`` reports it as such
        stacked = False
    if not stacked:
        return _load(data, KVCoreConfig, "", beside)
    if "backend" in data:
        raise ConfigError(
            "tiers", "<beside backend>", "either 'backend' (one tier) or 'tiers' (a list), not both"
        )
    try:
        fields = {k: v for k, v in data.items() if k != "tiers"}
        fields["backend"] = _Stacked(data["tiers"])
    except Exception:  # a mapping that fails when read: ``_load`` reports it as such
        return _load(data, KVCoreConfig, "", beside)
    try:
        return _load(fields, KVCoreConfig, "", beside)
    except ConfigError as exc:  # a tier's problem is found under ``backend``: name it as it was written
        field = "tiers" if exc.field == "backend" else exc.field.replace("backend.tiers", "tiers", 1)
        error = ConfigError(field, exc.value, exc.expected)
        for note in getattr(exc, "__notes__", ()):
            error.add_note(note.replace("backend.tiers", "tiers"))
        raise error from None


def load_pd_config(data: Mapping[str, object]) -> PDConfig:
    """Validate the ``pd`` section of a mapping alone (a P/D connector needs no tier backend); a missing
    section gives the defaults. Errors name ``pd.<field>``."""
    if not isinstance(data, Mapping):
        raise ConfigError("config", shown(data), "a mapping")
    return _load(data.get("pd", {}), PDConfig, "pd")


def _load(data: object, cls: type[_Loaded], path: str, beside: Collection[str] = ()) -> _Loaded:
    """Structure ``data`` as ``cls``; every failure, whatever raised it, becomes one ``ConfigError`` with
    a path (``path`` in front), and a note lists the other problems."""
    try:
        if not isinstance(data, Mapping):
            raise BadValue(data, "a mapping")
        return _CONVERTER.structure(dict(data), cls)
    except Exception as exc:  # every failure of hostile input is reported, not raised
        problems = list(_problems(exc, path, beside))
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
    """Read a JSON config file (``read_config_file``) and validate it (``load_config``)."""
    return load_config(read_config_file(path))


def read_config_file(
    path: str | Path, *, field: str = "config_file", yaml_load: Callable[[str], object] | None = None
) -> dict[str, Any]:
    """The mapping a config file holds. The file must be UTF-8 (a byte-order mark is skipped), at most
    1 MiB, and hold one object: JSON with no duplicate keys, no NaN or Infinity and no integer of more
    than 100 digits, or, for a ``.yaml``/``.yml`` file, YAML read by ``yaml_load`` (an adapter's: the
    core reads no YAML itself). Anything else is a ``ConfigError`` naming ``field`` and the path."""

    def refuse(expected: str) -> NoReturn:
        raise ConfigError(field, str(path), expected)

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
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        return read_config_text(text, field=field, source=str(path))
    if yaml_load is None:
        refuse("a JSON file (YAML is read by the engine adapters that take it)")
    try:
        data = yaml_load(text)
    except Exception as exc:  # the loader's error, whatever its type: the file is not valid YAML
        refuse(f"valid YAML ({exc})")
    if not isinstance(data, dict):
        refuse(f"a mapping at the top level, not {shown(data)!r}")
    return data


def read_config_text(text: str, *, field: str = "config", source: str | None = None) -> dict[str, Any]:
    """The JSON object ``text`` holds, read as ``read_config_file`` reads a file's; a ``ConfigError``
    naming ``field`` and ``source`` (the text itself by default) otherwise."""

    def refuse(expected: str) -> NoReturn:
        raise ConfigError(field, source if source is not None else shown(text), expected)

    if not text.strip():
        refuse("a JSON object (it is empty)")
    try:
        data = json.loads(
            text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_int=_short_integer
        )
    except ValueError as exc:  # json.JSONDecodeError or _NotJSON
        refuse(f"valid JSON ({exc})")
    except RecursionError:
        refuse("valid JSON nested less deeply")
    if not isinstance(data, dict):
        refuse(f"a JSON object at the top level, not {shown(data)!r}")
    return data


def config_to_dict(config: KVCoreConfig) -> dict[str, Any]:
    """The resolved values, JSON-ready, with the secret masked (a stack of tiers as its ``tiers`` list)."""
    data: dict[str, Any] = _CONVERTER.unstructure(config)
    if isinstance(config.backend, TierStack):
        del data["backend"]
        unstructure = _CONVERTER.unstructure
        data["tiers"] = [unstructure(config.backend.local, BackendSettings)] + [
            {**unstructure(t.settings, BackendSettings), "admit_after": t.admit_after, "write": t.write}
            for t in config.backend.remote
        ]
    if data.get("secret") is not None:
        data["secret"] = "***"
    return data
