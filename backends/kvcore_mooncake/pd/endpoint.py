"""``Endpoint``: what makes one rank reachable by its peers, started and closed the same way for a
producer and a consumer.

Starting registers the rank's KV with its ``PeerTransport`` (peers write into it, the transport reads
from it) and opens the side channel, answering with the side's handler; the rank's description
(``RankInfo``) is then what its handshakes send. Closing undoes both. A side stops its own threads and
settles its writes before it closes the endpoint, so that no memory is unregistered under a write it
still awaits; a producer stops serving first (``stop_serving``), so that no pull starts meanwhile.
"""

from __future__ import annotations

import zmq

from kvcore.config import PDConfig
from kvcore.errors import BackendError, UsageError
from kvcore.ports import PeerTransport
from kvcore_mooncake.pd.handshake import rank_info
from kvcore_mooncake.pd.messages import RankInfo
from kvcore_mooncake.pd.side_channel import Handler, SideChannelClient, SideChannelServer, listen_port
from kvcore_mooncake.pd.spec import RankSpec

__all__ = ["Endpoint"]


class Endpoint:
    """One rank's registration and side channel. It starts once; ``close`` is idempotent, and a closed
    endpoint does not start again."""

    def __init__(self, role: str, spec: RankSpec, transport: PeerTransport, config: PDConfig) -> None:
        self._role = role
        self._spec = spec
        self._transport = transport
        self._config = config
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._server: SideChannelServer | None = None
        self._closed = False
        self.info: RankInfo | None = None
        """This rank as handshakes describe it; ``None`` until started."""

    def start(self, handler: Handler) -> str:
        """Register the KV and answer side-channel requests with ``handler``; returns the address.

        Raises ``UsageError`` when started before, ``BackendError`` (nothing left open) when the transport
        or the side channel refuses.
        """
        if self._context is not None or self._closed:
            raise UsageError(f"the {self._role} was started before")
        self._transport.register(self._spec.regions)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            port = listen_port(self._config, self._spec.tp_rank)
            server = SideChannelServer(context, self._config.host, port, handler)
        except BackendError:
            self._transport.unregister(self._spec.regions)
            context.term()
            raise
        self._context, self._server = context, server
        self.info = rank_info(self._spec, self._transport.address, server.address)
        return server.address

    @property
    def running(self) -> bool:
        """Started and not closed."""
        return self._context is not None and not self._closed

    @property
    def address(self) -> str:
        """The side channel's address (``tcp://host:port``): what peers handshake with."""
        if self._server is None:
            raise UsageError(f"the {self._role} is not started")
        return self._server.address

    def client(self) -> SideChannelClient:
        """A client for requests to peers, from one thread; the caller closes it before ``close``."""
        if self._context is None:
            raise UsageError(f"the {self._role} is not started")
        return SideChannelClient(
            self._context, self._config.handshake_timeout_s, self._config.handshake_retries
        )

    def stop_serving(self) -> None:
        """Answer no more requests. Idempotent."""
        if self._server is not None:
            self._server.close()

    def close(self) -> None:
        """Stop serving, withdraw the KV's registration, end the ZMQ context (which waits for the
        clients to be closed). Idempotent; nothing to do before ``start``."""
        if not self.running:
            return
        self._closed = True
        self.stop_serving()
        self._transport.unregister(self._spec.regions)
        if self._context is not None:
            self._context.term()
