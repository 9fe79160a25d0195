"""The ``vllm.general_plugins`` entry point: registers kvcore's connectors once per vLLM process.

vLLM resolves the connector class in its main, engine-core and worker processes and calls every general
plugin in each of them, so registration must be idempotent: the factory raises on a second registration
of the same name.
"""

from __future__ import annotations

from kvcore_vllm import CONNECTORS

__all__ = ["register"]


def register() -> None:
    """Make ``kv_connector`` "KVCoreConnector" and "KVCorePDConnector" resolvable without a module path."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)
