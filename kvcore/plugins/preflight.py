"""The pre-flight check: everything an engine would refuse about a config, found before it loads a model.

``preflight`` reads a config as the engine does (``load_config``), then asks each tier's backend what it
can check without opening the tier (``SupportsPreflight``: a folder that exists and can be written, a
server that answers, a client library that imports), then checks the host memory the tiers ask for
against what the machine has available beside the engine's own reservation, and, given the engine, that
the pool buys at least one slot per rank (``kvcore.plugins.sizing``, the function the engine calls). Each
outcome is a ``Finding``: refused (the engine would stop, with the same ``ConfigError``), a warning (the
engine runs, worse: a server that is down serves misses), or fine (what was found, for the report).

An engine adapter runs it in the first process that sees the config (vLLM: before the engine core is
spawned) and stops on the first refusal; ``kvcore doctor`` prints every finding as a table. Both call this
one function, so they agree. Every network check is bounded by ``timeout_s``; only ``deep`` checks
(``kvcore doctor``) read more than a few files.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs
from attrs import field, frozen

from kvcore.config.describe import describe
from kvcore.config.loading import load_config
from kvcore.config.model import KVCoreConfig
from kvcore.config.tiers import TierStack
from kvcore.errors import ConfigError
from kvcore.kit.settings import BackendSettings, format_size
from kvcore.plugins import registry
from kvcore.plugins.sizing import host_field

__all__ = [
    "EngineFlags",
    "Finding",
    "HostMemory",
    "PreflightContext",
    "Report",
    "SupportsPreflight",
    "Verdict",
    "host_memory",
    "preflight",
    "tier_fields",
]

SMALL_POOL = 2**20
"""A host pool below this holds no chunk of any real model: without the engine's shape, a warning."""


class Verdict(enum.Enum):
    """What the engine would do about a finding."""

    OK = "ok"
    WARNING = "warning"
    REFUSED = "refused"


@frozen
class Finding:
    """One check's outcome. ``check`` names what was checked (``config``, ``memory``, ``path``, ``server``,
    ``dependency``, ``chunks``), ``field`` the config field it is about; ``text`` is what was expected
    for a refusal (as its ``ConfigError`` says it) and what was found otherwise; ``value`` is the value
    refused."""

    check: str
    field: str
    verdict: Verdict
    text: str
    value: object = None

    @classmethod
    def refusal(cls, check: str, error: ConfigError) -> Finding:
        return cls(check, error.field, Verdict.REFUSED, error.expected, error.value)

    def error(self) -> ConfigError:
        """The refusal as the engine raises it."""
        return ConfigError(self.field, self.value, self.text)

    def line(self) -> str:
        """One line: ``field: got value, expected ...`` for a refusal, ``field: text`` otherwise."""
        return str(self.error()) if self.verdict is Verdict.REFUSED else f"{self.field}: {self.text}"


@frozen
class PreflightContext:
    """What a backend's pre-flight knows beside its settings: the field its settings sit under
    (``backend`` or ``tiers[<n>]``), the bound of every network check, and whether slow checks (a scan
    of a tier's contents) are wanted."""

    field: str
    timeout_s: float
    deep: bool


@runtime_checkable
class SupportsPreflight(Protocol):
    """A ``kvcore.plugins.Backend`` that checks its settings before anything opens them. It must find
    exactly what its ``open_*`` would refuse, without opening the tier or changing anything, and bound
    every network call by ``context.timeout_s``."""

    def preflight(self, config: KVCoreConfig, context: PreflightContext) -> Iterable[Finding]:
        """The findings about ``config.backend`` (this backend's settings: read them with
        ``settings_of``), each under ``context.field``."""
        ...


@frozen
class EngineFlags:
    """What ``kvcore doctor`` was told of the engine beside the config (vLLM's flags of the same meaning):
    its model, its tensor-parallel size, the host memory it takes for its own KV cache (``cache_bytes``)
    or the share of the machine's memory it reserves (``memory_share``); and the bound of each server
    check."""

    model: str | None = None
    tensor_parallel_size: int = 1
    cache_bytes: int | None = None
    memory_share: float | None = None
    timeout_s: float = 2.0


@frozen
class HostMemory:
    """The machine's memory as an engine starting now sees it, in bytes."""

    total: int
    available: int


def host_memory() -> HostMemory | None:
    """This machine's memory (Linux: ``/proc/meminfo``'s ``MemTotal`` and ``MemAvailable``), or ``None``
    where the platform does not tell."""
    try:
        with open("/proc/meminfo", encoding="ascii") as lines:
            fields = dict(line.split(":", 1) for line in lines if ":" in line)
        return HostMemory(
            int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024
        )
    except (OSError, KeyError, ValueError, IndexError):
        return None


@frozen
class Report:
    """Every finding of one pre-flight, in the order checked; the config when it read, and the mapping it
    was read from (whose spellings ``kvcore.config.describe`` shows)."""

    findings: tuple[Finding, ...]
    config: KVCoreConfig | None = field(default=None)
    given: Mapping[str, object] = field(factory=dict)

    @property
    def refusals(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.verdict is Verdict.REFUSED)

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.verdict is Verdict.WARNING)

    def describe(self) -> str:
        """What will run (``kvcore.config.describe``), ``""`` when the config did not read."""
        return describe(self.config, self.given) if self.config is not None else ""

    def raise_refusal(self) -> None:
        """Raise the first refusal as the engine would (the others in a note); nothing if none."""
        if not self.refusals:
            return
        first, *others = self.refusals
        error = first.error()
        if others:
            error.add_note("also: " + "; ".join(f.line() for f in others))
        raise error


def preflight(
    data: Mapping[str, object],
    *,
    beside: Collection[str] = (),
    slot_floor: int | None = None,
    world_size: int = 1,
    engine_host_bytes: int = 0,
    engine_reserve: str = "",
    timeout_s: float = 2.0,
    deep: bool = False,
    memory: Callable[[], HostMemory | None] | None = host_memory,
) -> Report:
    """Check ``data`` (a kvcore config mapping) as the engine would, and more.

    ``beside`` are an engine adapter's own keys (``load_config``'s). ``slot_floor``, when the engine's
    model is known, is the least one chunk of one rank's shard can take (its K and V bytes, padding left
    out: never more than the engine counts), so that a pool below one slot on each of ``world_size``
    ranks is refused as the engine would refuse it. ``engine_host_bytes`` is the host memory the engine
    itself reserves (vLLM on CPU: its KV cache), described by ``engine_reserve``: the tiers' host memory
    is checked against what is left beside it, as ``memory`` tells it (``None``: not checked)."""
    try:
        config = load_config(data, beside=beside)
    except ConfigError as exc:
        return Report((Finding.refusal("config", exc),))
    findings = [Finding("config", "config", Verdict.OK, "every key and value is valid")]
    for name, settings in tier_fields(config):
        plugin = registry.backend(settings.KIND)
        if isinstance(plugin, SupportsPreflight):
            tier = attrs.evolve(config, backend=settings)
            try:
                findings += plugin.preflight(tier, PreflightContext(name, timeout_s, deep))
            except Exception as exc:  # a plugin's bug must not stop an engine its tier would serve
                text = f"the {settings.KIND} backend's pre-flight failed ({type(exc).__name__}: {exc})"
                findings.append(Finding("backend", name, Verdict.WARNING, text))
    if memory is not None:
        findings += _memory(config, memory(), engine_host_bytes, engine_reserve)
    findings += _slots(config, slot_floor, world_size)
    return Report(tuple(findings), config, data)


def tier_fields(config: KVCoreConfig) -> tuple[tuple[str, BackendSettings], ...]:
    """Each tier's settings and the field they sit under: ``backend``, or ``tiers[<n>]`` in a stack."""
    stack = config.backend
    if isinstance(stack, TierStack):
        return (
            ("tiers[0]", stack.local),
            *((f"tiers[{n}]", t.settings) for n, t in enumerate(stack.remote, 1)),
        )
    return (("backend", stack),)


def _node_bytes(config: KVCoreConfig) -> tuple[int, str]:
    """The host memory the tiers ask of this machine, summed, and the field that asks the most: the
    first tier's pool, and what each tier behind it holds beside a pool of its own (a stacked tier
    stages through the first tier's pool, not its own)."""
    asks = [
        (int(getattr(settings, name)), f"{field}.{name}")
        for n, (field, settings) in enumerate(tier_fields(config))
        for name in settings.NODE_FIELDS
        if n == 0 or name != settings.HOST_FIELD
    ]
    return sum(size for size, _ in asks), max(asks)[1] if asks else "backend"


def _memory(
    config: KVCoreConfig, machine: HostMemory | None, engine_bytes: int, engine_reserve: str
) -> Sequence[Finding]:
    asked, largest = _node_bytes(config)
    if machine is None:
        return [Finding("memory", largest, Verdict.WARNING, "this platform does not tell its free memory")]
    beside = f" beside {engine_reserve}" if engine_bytes else ""
    found = (
        f"{format_size(asked)} of host memory for the tiers{beside}; {format_size(machine.available)} of "
        f"{format_size(machine.total)} available now"
    )
    if asked + engine_bytes > machine.available:
        expected = (
            f"host memory that fits: the tiers ask {format_size(asked)}{beside}, and this machine has "
            f"{format_size(machine.available)} available (set a smaller size"
            + (", or give the engine less" if engine_bytes else "")
            + ")"
        )
        return [Finding("memory", largest, Verdict.REFUSED, expected, _value_at(config, largest))]
    return [Finding("memory", largest, Verdict.OK, found)]


def _slots(config: KVCoreConfig, floor: int | None, world_size: int) -> Sequence[Finding]:
    """Whether the pool holds a slot on each rank: counted from the engine's least slot size when the
    model is known; without it, a pool too small for any model is a warning."""
    backend = config.backend
    pool, name = backend.host_bytes, host_field(config)
    if backend.MOVES_BLOCKS and pool == 0:
        return []  # no pool: blocks move straight to the tier's own memory
    if floor is not None:
        slots = pool // world_size // floor
        if slots < 1:
            expected = (
                f"at least {floor * world_size} bytes ({format_size(floor * world_size)}): one chunk of "
                f"{config.chunk_tokens} tokens (at least {format_size(floor)}) on each of {world_size} "
                "rank(s)"
            )
            return [Finding("memory", name, Verdict.REFUSED, expected, pool)]
        return [
            Finding(
                "memory", name, Verdict.OK, f"at most {slots} chunks of {config.chunk_tokens} tokens per rank"
            )
        ]
    if pool < SMALL_POOL:
        text = (
            f"{format_size(pool)} holds no chunk of any real model (a number is bytes: did you mean "
            f"'{pool}GiB'?)"
        )
        return [Finding("memory", name, Verdict.WARNING, text)]
    return []


def _value_at(config: KVCoreConfig, path: str) -> object:
    """The value at ``path`` (``backend.size``, ``tiers[1].local_size``) of ``config``."""
    tier, _, name = path.rpartition(".")
    settings = dict(tier_fields(config)).get(tier)
    return getattr(settings, name, None)
