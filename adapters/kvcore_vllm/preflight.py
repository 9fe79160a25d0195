"""kvcore's config checked in the first vLLM process that sees it, before any model loads.

vLLM builds the engine's config (``EngineArgs.create_engine_config``) in its API server (or in the
process that makes an ``LLM``) before it spawns the engine core, whose workers load the weights; kvcore's
connector is built only after that, minutes later on a big model. The plugin (``kvcore_vllm.plugin``)
wraps that one method so that ``check_before_start`` runs on the config it returns: the adapter's keys
and the core's config are read as the connector will read them, and the pre-flight
(``kvcore.plugins.preflight``) checks each tier (paths, servers, libraries) and the host memory beside
vLLM's own KV cache, with the model's shape where vLLM knows it. A refusal raises the ``ConfigError`` the
engine would raise; warnings are logged; one line says what will run.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import kvcore
from kvcore.config import load_pd_config
from kvcore.errors import ConfigError
from kvcore.kit.settings import format_size
from kvcore.plugins.preflight import Report, Verdict, host_memory, preflight
from kvcore_vllm import CONNECTOR_NAME, PD_CONNECTOR_NAME
from kvcore_vllm.settings import ADAPTER_KEYS, core_mapping, extra_mapping, read_extra_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "RefusedAtStart",
    "check_before_start",
    "check_command_line",
    "check_pd",
    "enabled",
    "engine_reserve",
    "kvcore_connectors",
    "slot_floor",
    "vllm_memory",
]

log = logging.getLogger(__name__)

DEFAULT_UTILIZATION = 0.92
"""vLLM's default ``--gpu-memory-utilization``: on CPU, the share of the machine's memory it reserves."""
SWITCH = "KVCORE_PREFLIGHT"
"""The environment variable that turns the pre-flight off (``0``): the engine's own checks still run, at
its start, in the process that opens each tier (for a deployment whose first process cannot see the
engine's paths or servers)."""
PREFLIGHT_TIMEOUT_S = 2.0
"""The bound of each server the pre-flight asks (a server that takes longer is down, to a person)."""


class RefusedAtStart(ConfigError):
    """The ``ConfigError`` the engine would raise, raised by the pre-flight before it started."""

    @classmethod
    def of(cls, error: ConfigError) -> RefusedAtStart:
        refused = cls(error.field, error.value, error.expected)
        for note in getattr(error, "__notes__", ()):
            refused.add_note(note)
        return refused


def check_before_start(vllm_config: VllmConfig) -> list[Report]:
    """Check kvcore's part of ``vllm_config`` with everything vLLM knows by then: the model's shape, its
    own host memory. Raises ``RefusedAtStart`` for what the engine would refuse; logs the warnings and
    one line of what will run. A report per kvcore connector (none when none is configured)."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None or not enabled():
        return []
    return _check(transfer.kv_connector, transfer.kv_connector_extra_config, transfer.kv_role, vllm_config)


def check_command_line(argv: Sequence[str]) -> list[Report]:
    """Check the ``--kv-transfer-config`` JSON on a command line, as soon as a process starts (before
    vLLM reads its arguments, and before it builds the model's config, which takes seconds): the config
    and each tier, not yet the memory. Raises ``RefusedAtStart``; a value that is not a JSON mapping is
    left to vLLM, which refuses it."""
    value = _argument(argv, "--kv-transfer-config") if enabled() else None
    try:
        data = json.loads(value) if value is not None else None
    except json.JSONDecodeError:
        return []
    if not isinstance(data, dict):
        return []
    extra = data.get("kv_connector_extra_config")
    return _check(
        data.get("kv_connector"), extra if isinstance(extra, dict) else {}, data.get("kv_role"), None
    )


def enabled() -> bool:
    """Whether the pre-flight runs (``KVCORE_PREFLIGHT`` unset, or anything but ``0``)."""
    return os.environ.get(SWITCH, "1").strip() != "0"


def _argument(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` on ``argv`` (``name value`` or ``name=value``; the last one wins, as in
    argparse)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(f"{name}="):
            found = arg.split("=", 1)[1]
    return found


def _check(
    kv_connector: object, extra: dict[str, Any], kv_role: object, vllm_config: VllmConfig | None
) -> list[Report]:
    try:
        reports = []
        for connector, child in kvcore_connectors(kv_connector, extra):
            if connector == PD_CONNECTOR_NAME:
                check_pd(child, kv_role)
            else:
                read_extra_config(
                    child
                )  # the adapter's keys and the core's config, as the connector reads them
                if "pd" in child:  # P/D beside the tiers: the role too, as the connector reads it
                    from kvcore_vllm.pd_scheduler import PDRole

                    PDRole.of(kv_role)
                reports.append(_preflight(child, vllm_config))
        return reports
    except ConfigError as exc:
        raise RefusedAtStart.of(exc) from None


def _preflight(extra: dict[str, Any], vllm_config: VllmConfig | None) -> Report:
    """The pre-flight of one connector's config; with ``vllm_config``, the memory and the model's slot too,
    the warnings logged and what runs said."""
    data = core_mapping(extra_mapping(extra))
    if vllm_config is None:
        report = preflight(data, beside=ADAPTER_KEYS, timeout_s=PREFLIGHT_TIMEOUT_S, memory=None)
        report.raise_refusal()
        return report
    reserved, what = engine_reserve(vllm_config)
    report = preflight(
        data,
        beside=ADAPTER_KEYS,
        slot_floor=slot_floor(vllm_config, extra),
        world_size=vllm_config.parallel_config.tensor_parallel_size,
        engine_host_bytes=reserved,
        engine_reserve=what,
        timeout_s=PREFLIGHT_TIMEOUT_S,
    )
    for finding in report.warnings:
        log.warning("kvcore pre-flight: %s", finding.line())
    report.raise_refusal()
    found = [f.line() for f in report.findings if f.verdict is Verdict.OK and f.check in ("chunks", "server")]
    log.info(
        "kvcore %s pre-flight passed: %s%s",
        kvcore.__version__,
        report.describe(),
        "; " + "; ".join(found) if found else "",
    )
    return report


def check_pd(extra: dict[str, Any], kv_role: object) -> None:
    """What ``KVCorePDConnector`` refuses at construction: no ``pd`` section, a bad one, a role it does
    not play."""
    if "pd" not in extra:
        raise ConfigError("pd", None, "a 'pd' section in kv_connector_extra_config for KVCorePDConnector")
    from kvcore_vllm.pd_scheduler import PDRole

    load_pd_config(extra)  # the P/D section alone: this connector needs no tier backend
    PDRole.of(kv_role)


def kvcore_connectors(kv_connector: object, extra: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """kvcore's connectors and each one's extra config: the connector itself, or the children of a
    MultiConnector that are kvcore's."""
    ours = (CONNECTOR_NAME, PD_CONNECTOR_NAME)
    if kv_connector in ours:
        return [(str(kv_connector), dict(extra or {}))]
    if kv_connector == "MultiConnector":
        children = (extra or {}).get("connectors", [])
        return [
            (str(child["kv_connector"]), dict(child.get("kv_connector_extra_config") or {}))
            for child in children
            if isinstance(child, dict) and child.get("kv_connector") in ours
        ]
    return []


def engine_reserve(vllm_config: VllmConfig) -> tuple[int, str]:
    """The host memory vLLM itself takes for its KV cache (on CPU; on a GPU its cache is device memory:
    none), and how it was asked for."""
    from vllm.platforms import current_platform

    cache = vllm_config.cache_config
    return vllm_memory(
        cache.kv_cache_memory_bytes, cache.gpu_memory_utilization, on_cpu=current_platform.is_cpu()
    )


def vllm_memory(cache_bytes: int | None, share: float | None, *, on_cpu: bool) -> tuple[int, str]:
    """The host memory vLLM takes beside kvcore, and how it was asked for: its KV cache where its size
    is given (``--kv-cache-memory-bytes``, or ``VLLM_CPU_KVCACHE_SPACE``), else, on CPU, the share of
    the machine's memory it reserves (``--gpu-memory-utilization``, ``DEFAULT_UTILIZATION`` unless
    given); none on a GPU, where its cache is device memory."""
    if not on_cpu:
        return 0, ""
    if cache_bytes is not None:
        flag = (
            "VLLM_CPU_KVCACHE_SPACE"
            if os.environ.get("VLLM_CPU_KVCACHE_SPACE")
            else "--kv-cache-memory-bytes"
        )
        return cache_bytes, f"vLLM's KV cache of {format_size(cache_bytes)} ({flag})"
    memory = host_memory()
    if memory is None:
        return 0, ""
    used = share if share is not None else DEFAULT_UTILIZATION
    default = "" if share is not None else ", its default"
    reserved = int(memory.total * used)
    return reserved, (
        f"vLLM's reservation of {format_size(reserved)} (--gpu-memory-utilization {used:g}{default}, of "
        f"{format_size(memory.total)}; --kv-cache-memory-bytes sizes its KV cache instead)"
    )


def slot_floor(vllm_config: VllmConfig, extra: dict[str, Any]) -> int | None:
    """The least bytes one chunk of one rank's shard takes (its K and V, nothing else), from vLLM's model
    config; ``None`` for the models whose chunk size or state kvcore decides later (hybrid, SSM,
    attention-free)."""
    model = vllm_config.model_config
    if model.is_hybrid or model.is_attention_free or model.has_inner_state:
        return None
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    parallel = vllm_config.parallel_config
    dtype = kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, model)
    layers = model.get_num_layers_by_block_type(parallel, "attention")
    planes = 1 if model.use_mla else 2
    data = extra_mapping(extra)
    chunk = data.get("chunk_tokens", 256)
    if not isinstance(chunk, int):
        return None
    return chunk * planes * layers * model.get_num_kv_heads(parallel) * model.get_head_size() * dtype.itemsize
