"""The vLLM adapter's pieces that need no engine: extra-config reading, the one-knob helper, the
version check and the plugin's idempotent registration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcore.errors import ConfigError, UnsupportedConfiguration
from kvcore.kit.settings import ByteCount, ByteSize
from kvcore.testing.faults import TransferDelays
from kvcore_cli.vllm_config import CONNECTOR_NAME, transfer_config
from kvcore_cpu.config import CPUBackendConfig
from kvcore_lmcache.config import LMCacheMPConfig
from kvcore_mooncake.config import MooncakeStoreConfig
from kvcore_vllm import CONNECTOR_NAME as REGISTERED_NAME
from kvcore_vllm.compat import check_vllm
from kvcore_vllm.settings import StorePolicy, read_extra_config

HOOKS = TransferDelays()


def test_extra_config_is_the_core_config() -> None:
    config = read_extra_config({"backend": {"kind": "cpu", "size": "4GiB"}, "chunk_tokens": 512}).core
    assert isinstance(config.backend, CPUBackendConfig)
    assert config.backend.size == 4 << 30
    assert config.chunk_tokens == 512


def test_the_settings_say_whether_the_config_set_chunk_tokens(tmp_path: Path) -> None:
    # a hybrid SSM model's chunks are vLLM's block unless the config sets them
    assert read_extra_config(
        {"backend": {"kind": "cpu", "size": "1GiB"}, "chunk_tokens": 256}
    ).chunk_tokens_set
    unset = read_extra_config({"backend": {"kind": "cpu", "size": "1GiB"}})
    assert (unset.chunk_tokens_set, unset.core.chunk_tokens) == (False, 256)
    as_json = tmp_path / "kvcore.json"
    as_json.write_text(json.dumps({"backend": {"kind": "cpu", "size": "1GiB"}, "chunk_tokens": 512}))
    assert read_extra_config({"config_file": str(as_json)}).chunk_tokens_set


def test_bad_extra_config_names_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        read_extra_config({"backend": {"kind": "cpu", "size": "4 bananas"}})
    assert info.value.field == "backend.size"


def test_config_file_json_and_yaml(tmp_path: Path) -> None:
    as_json = tmp_path / "kvcore.json"
    as_json.write_text(json.dumps({"backend": {"kind": "cpu", "size": "1GiB"}, "eviction": "arc"}))
    assert read_extra_config({"config_file": str(as_json)}).core.eviction == "arc"
    pytest.importorskip("yaml", reason="PyYAML comes with vLLM")
    as_yaml = tmp_path / "kvcore.yaml"
    as_yaml.write_text("backend:\n  kind: cpu\n  size: 2GiB\nchunk_tokens: 128\n")
    assert read_extra_config({"config_file": str(as_yaml)}).core.chunk_tokens == 128


def test_store_policy_is_the_adapters_key() -> None:
    backend = {"kind": "cpu", "size": "1GiB"}
    assert read_extra_config({"backend": backend}).store_policy is StorePolicy.EAGER
    lazy = read_extra_config({"backend": backend, "store_policy": "lazy"})
    assert lazy.store_policy is StorePolicy.LAZY
    assert lazy.core.backend == CPUBackendConfig(ByteSize(1 << 30))
    with pytest.raises(ConfigError) as info:
        read_extra_config({"backend": backend, "store_policy": "sometimes"})
    assert info.value.field == "store_policy"
    with pytest.raises(ConfigError, match="save_after_sightings"):
        read_extra_config({"backend": backend, "store_policy": "lazy", "save_after_sightings": 2})


def test_fault_hooks_are_the_adapters_key_named_by_import_path() -> None:
    backend = {"kind": "cpu", "size": "1GiB"}
    assert read_extra_config({"backend": backend}).faults is None
    named = read_extra_config({"backend": backend, "faults": f"{__name__}:HOOKS"})
    assert named.faults is HOOKS
    assert named.core == read_extra_config({"backend": backend}).core
    for bad in ("nowhere", f"{__name__}:missing", f"{__name__}:read_extra_config", 3):
        with pytest.raises(ConfigError) as info:
            read_extra_config({"backend": backend, "faults": bad})
        assert (info.value.field, info.value.value) == ("faults", bad)


def test_config_file_problems(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config_file"):
        read_extra_config({"config_file": str(tmp_path / "nope.json")})
    with pytest.raises(ConfigError, match="kv_connector_extra_config"):
        read_extra_config({"config_file": "x.json", "chunk_tokens": 3})
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="a JSON object at the top level"):
        read_extra_config({"config_file": str(listed)})


def test_the_cli_spells_the_connector_as_the_adapter_registers_it() -> None:
    assert CONNECTOR_NAME == REGISTERED_NAME


def test_one_knob_transfer_config() -> None:
    config = transfer_config(backend="cpu", size="8GiB")
    assert config["kv_connector"] == "KVCoreConnector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert read_extra_config(config["kv_connector_extra_config"]).core.backend == CPUBackendConfig(
        ByteSize(8 << 30)
    )
    with pytest.raises(ConfigError, match="backend"):
        transfer_config(backend="floppy")
    with pytest.raises(ConfigError, match="size"):
        transfer_config(size="-1GiB")


def test_one_knob_transfer_config_for_remote_tiers() -> None:
    lmcache = read_extra_config(transfer_config(backend="lmcache_mp")["kv_connector_extra_config"]).core
    assert lmcache.backend == LMCacheMPConfig(url="tcp://localhost:5555", local_size=ByteCount(0))
    pooled = transfer_config(backend="lmcache_mp", size="8GiB")["kv_connector_extra_config"]
    assert read_extra_config(pooled).core.backend == LMCacheMPConfig(local_size=ByteCount(8 << 30))
    mooncake = transfer_config(backend="mooncake_store", size="1GiB", endpoint="10.0.0.5:50051")
    core = read_extra_config(mooncake["kv_connector_extra_config"]).core
    assert core.backend == MooncakeStoreConfig(master="10.0.0.5:50051", local_size=ByteSize(1 << 30))
    with pytest.raises(ConfigError, match="endpoint"):
        transfer_config(backend="cpu", endpoint="10.0.0.5:50051")


class _Base:
    def __init__(self, vllm_config: object, role: object, kv_cache_config: object) -> None: ...


def test_unknown_vllm_version_is_refused() -> None:
    with pytest.raises(UnsupportedConfiguration, match=r"0\.32"):
        check_vllm("0.40.1", _Base)


def test_unknown_connector_api_is_refused() -> None:
    with pytest.raises(UnsupportedConfiguration, match="missing hooks"):
        check_vllm("0.32.0", _Base)


def test_producer_side_channel_ports_must_fit_every_rank() -> None:
    import warnings

    from kvcore.config import load_pd_config

    with warnings.catch_warnings():  # vLLM and torch warn about their own deprecations on import
        warnings.simplefilter("ignore")
        from kvcore_vllm.pd_scheduler import producer_addresses

    assert producer_addresses(load_pd_config({"pd": {"port": 65534}}), 2)[-1].endswith(":65535")
    with pytest.raises(ConfigError, match=r"pd\.port: got 65535, expected at most 65534"):
        producer_addresses(load_pd_config({"pd": {"port": 65535}}), 2)
