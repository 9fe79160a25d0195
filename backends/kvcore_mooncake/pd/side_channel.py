"""The side channel: small request/reply messages between ranks of a prefill and a decode engine.

``SideChannelServer`` binds a ZMQ ROUTER socket (loopback unless configured otherwise; port 0 picks a free
one) and answers every request on its own thread through a handler; a request that does not decode, or
whose handler fails, is answered with ``Refused`` so that no peer is left waiting. ``SideChannelClient``
sends requests from one thread with a timeout per attempt and a bounded number of retries with
exponential back-off; it never waits forever, and a peer that stays silent becomes ``BackendUnavailable``.
Requests are idempotent on the receiving side, so a retry after a lost reply is harmless.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from kvcore.config import PDConfig
from kvcore.errors import BackendError, BackendUnavailable, KVCoreError
from kvcore_mooncake.pd.messages import Refused, Reply, Request, decode_reply, decode_request, encode

__all__ = ["Handler", "SideChannelClient", "SideChannelServer", "listen_port"]

log = logging.getLogger(__name__)

Handler = Callable[[Request], Reply]

_POLL_MS = 50  # how often the server looks at its stop flag
_BACKOFF_S = 0.05  # first pause between attempts; doubles up to _MAX_BACKOFF_S
_MAX_BACKOFF_S = 1.0


def listen_port(config: PDConfig, tp_rank: int) -> int:
    """Rank ``r`` listens on ``config.port + r``, so that a peer finds every rank from one address; with
    port 0 each rank picks a free port and the ranks' addresses must be handed to peers explicitly."""
    return config.port + tp_rank if config.port else 0


class SideChannelServer:
    """Answers requests on ``address`` with ``handler`` on a background thread until ``close``."""

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], host: str, port: int, handler: Handler
    ) -> None:
        self._handler = handler
        self._socket: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
            else:
                self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._socket.close()
            raise BackendUnavailable(f"side channel cannot listen on {host}:{port}: {exc}") from exc
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvcore-pd-side-channel", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop answering and close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._socket.poll(_POLL_MS, zmq.POLLIN):
                    continue
                frames = self._socket.recv_multipart()
                if len(frames) != 3 or frames[1]:
                    continue  # not a REQ envelope: nobody is waiting for a reply
                self._socket.send_multipart([frames[0], b"", encode(self._answer(frames[2]))])
        finally:
            self._socket.close()

    def _answer(self, data: bytes) -> Reply:
        try:
            return self._handler(decode_request(data))
        except KVCoreError as exc:
            return Refused(str(exc))
        # A handler bug must still answer, or the peer waits out its timeout for nothing.
        except Exception as exc:
            log.exception("side-channel handler failed")
            return Refused(f"internal error: {type(exc).__name__}: {exc}")


class SideChannelClient:
    """Sends requests and waits for replies, from one thread (ZMQ sockets are not thread-safe).

    One REQ socket per peer address, kept between requests; a request that timed out resets it.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], timeout_s: float, retries: int) -> None:
        self._context = context
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._retries = retries
        self._sockets: dict[str, zmq.Socket[bytes]] = {}

    def request(self, address: str, message: Request, *, retries: int | None = None) -> Reply:
        """Send ``message`` to ``address`` and return the reply (``Refused`` included).

        Tries ``1 + retries`` times (default: the client's), each bounded by the timeout. Raises
        ``BackendUnavailable`` when no attempt got an answer, ``BackendError`` for a reply that does not
        decode.
        """
        payload = encode(message)
        attempts = 1 + (self._retries if retries is None else retries)
        pause = _BACKOFF_S
        for attempt in range(attempts):
            socket = self._socket(address)
            socket.send(payload)
            if socket.poll(self._timeout_ms, zmq.POLLIN):
                return decode_reply(socket.recv())
            self._drop(address)
            if attempt + 1 < attempts:
                time.sleep(pause)
                pause = min(2 * pause, _MAX_BACKOFF_S)
        raise BackendUnavailable(
            f"no reply from {address} to {type(message).__name__} after {attempts} attempt(s) of "
            f"{self._timeout_ms / 1000:.3f}s"
        )

    def close(self) -> None:
        for address in list(self._sockets):
            self._drop(address)

    def _socket(self, address: str) -> zmq.Socket[bytes]:
        socket = self._sockets.get(address)
        if socket is None:
            socket = self._context.socket(zmq.REQ)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.connect(address)
            except zmq.ZMQError as exc:
                socket.close()
                raise BackendError(f"bad side-channel address {address!r}: {exc}") from exc
            self._sockets[address] = socket
        return socket

    def _drop(self, address: str) -> None:
        socket = self._sockets.pop(address, None)
        if socket is not None:
            socket.close()
