"""One client's connection to an LMCache server: chunk size agreement, layout registration, the shared-
memory slots, liveness, and the health of it all.

The server may be absent at start, answer a bad request with silence, restart with an empty cache and a
new shared-memory segment, or run without a shared-memory pool (started without ``--shm-name``: it
accepts the registration and answers it with an empty pool name and size 0). The link turns each of
these into "unavailable for now" (callers then miss at once) and a background heartbeat brings it back:
it pings (so the server does not reap this worker), re-registers the layout (a restarted server has
forgotten it) and re-maps the segment when the server created a new one. Every wait on the server is
bounded by the configured request timeout. (A little over 400 lines: the heartbeat and the calls it
guards share the connection's state and its lock.)
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import queue
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import zmq
from attrs import frozen
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey, RegisterEngineDrivenContextPayload
from lmcache.v1.multiprocess.futures import MessagingFuture
from lmcache.v1.multiprocess.transport.base import RequestClient
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

from kvcore.errors import BackendError, BackendUnavailable, ConfigError, TransferTimeout
from kvcore.ids import ChunkKey, RequestId
from kvcore.kit.health import CircuitBreaker
from kvcore_lmcache.config import LMCacheMPConfig
from kvcore_lmcache.wire import HEADER_BYTES, KeyCodec, server_model_name

__all__ = ["NoSharedMemoryPool", "Segment", "ServerLink", "SlotLayout", "join", "register_slots"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_Release = tuple[tuple[IPCCacheServerKey, ...], str | None, tuple[MessagingFuture[Any], ...]]
_MIN_CHUNK_TOKENS = 8  # a key is rendered as eight token ids
LOCK_TRUST_S = 270.0
"""How long a read lock is released rather than left to lapse: under the server's default read-lock TTL
(``--l1-read-ttl-seconds`` 300), with room for a request timeout."""
_SHM_DIR = "/dev/shm"


class NoSharedMemoryPool(BackendUnavailable):
    """The server answers but has no shared-memory pool (it was started without ``--shm-name``): kvcore
    moves values only through that pool, so every call misses until the server is restarted with one."""

    def __init__(self, url: str) -> None:
        super().__init__(
            f"LMCache server {url} has no shared-memory pool (it was started without --shm-name), and "
            "kvcore moves KV only through one: restart it with `lmcache server ... "
            "--supported-transfer-mode auto --shm-name NAME`"
        )


@frozen
class SlotLayout:
    """What a worker registers: one slot of ``value_bytes`` (plus a header) per chunk, as opaque bytes.

    The value starts at the first multiple of ``align`` (counted from the start of the server's pool)
    after the slot's header, so that a block mover can address a slot's value as whole host blocks of
    the pool (``align`` = one host block); a slot has room for the padding that takes.
    """

    value_bytes: int
    align: int = 1

    @property
    def slot_bytes(self) -> int:
        return HEADER_BYTES + self.align - 1 + self.value_bytes

    def value_offset(self, slot_offset: int) -> int:
        """Where the value of the slot at ``slot_offset`` starts in the pool."""
        return -(-(slot_offset + HEADER_BYTES) // self.align) * self.align


class Segment:
    """The server's shared-memory pool, mapped here. Stale once the server re-created it."""

    def __init__(self, name: str, size: int) -> None:
        self.path = os.path.join(_SHM_DIR, name.lstrip("/"))
        self.size = size
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._inode = os.fstat(fd).st_ino
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self._map)
        self.closed = False

    def stale(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self._inode
        except OSError:
            return True

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping itself, for a block mover over the pool (``kvcore_cpu.tier.MappedMover``)."""
        return self._map

    def close(self) -> None:
        """Unmap, or, while a block mover still holds the mapping, leave it to go with the mover's last
        reference (the tier replaces its mover at its next transfer). Either way ``closed`` from now on:
        nothing more is written here."""
        self.closed = True
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            log.debug("kvcore: %s is still mapped by a block mover; unmapped once it is dropped", self.path)


def register_slots(
    url: str,
    client: RequestClient,
    instance_id: int,
    model_name: str,
    chunk_tokens: int,
    slot_bytes: int,
    timeout: float,
    mapped: Segment | None = None,
) -> Segment:
    """Register an engine-driven context of opaque ``slot_bytes`` slots (one per chunk) and map the
    server's shared-memory pool; ``mapped`` is kept while it is still the server's current pool.

    Raises ``NoSharedMemoryPool`` for a server without a pool (started without ``--shm-name``): it
    registered the context all the same (for transfers as pickled tensors, which kvcore does not use).
    """
    payload = RegisterEngineDrivenContextPayload(
        instance_id=instance_id,
        model_name=model_name,
        world_size=1,
        block_size=chunk_tokens,
        num_layers=1,
        hidden_dim_size=slot_bytes,
        dtype_str="uint8",
        use_mla=True,
        num_physical_slots=1,
    )
    reply = client.register_kv_cache_engine_driven_context(payload).result(timeout=timeout)
    if not reply.shm_name or reply.pool_size <= 0:
        raise NoSharedMemoryPool(url)
    if mapped is not None and not mapped.stale():
        return mapped
    return Segment(reply.shm_name, reply.pool_size)


CLIENT_ATTEMPTS = 5
CLIENT_RETRY_S = 0.05


def open_client(factory: Callable[[str], RequestClient], url: str) -> RequestClient:
    """``factory(url)``, tried again (``CLIENT_ATTEMPTS`` times in all, ``CLIENT_RETRY_S`` apart) when ZMQ
    finds the client's monitor endpoint in use: pyzmq names it after the socket's file descriptor
    (``inproc://monitor.s-<fd>``), and a socket closed just before under the same descriptor releases
    its endpoint only when ZMQ's reaper thread gets to it. Any other error, or the last one, is raised."""
    attempt = 1
    while True:
        try:
            return factory(url)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or attempt >= CLIENT_ATTEMPTS:
                raise
            failed = exc
        attempt += 1
        with warnings.catch_warnings():  # the half-made client's socket is collected unclosed: quietly
            warnings.simplefilter("ignore", ResourceWarning)
            del failed
        time.sleep(CLIENT_RETRY_S)


class ServerLink:
    """A request client, its registration and its health, for one server URL.

    ``register`` is false on the scheduler side (lookups only; the workers register the layout, whose
    slot size is part of the server-side model name either way). The constructor never waits more
    than ``config.connect_timeout_s``: an absent server is a warning, and the heartbeat connects when
    it appears. A server without a shared-memory pool is one warning that says so (again only after it
    had one), and keeps the link down until it has one. A chunk size that differs from ``chunk_tokens``
    raises ``ConfigError`` at construction, or, found later, keeps the link down with a logged error.
    """

    def __init__(
        self,
        config: LMCacheMPConfig,
        chunk_tokens: int,
        model_name: str,
        layout: SlotLayout,
        *,
        register: bool = True,
        breaker: CircuitBreaker | None = None,
        client_factory: Callable[[str], RequestClient] = RequestClientFactory.create,
    ) -> None:
        if chunk_tokens < _MIN_CHUNK_TOKENS:
            raise ConfigError("chunk_tokens", chunk_tokens, f"an integer >= {_MIN_CHUNK_TOKENS}")
        self.config = config
        self.chunk_tokens = chunk_tokens
        self.layout = layout
        self._registers = register
        self.codec = KeyCodec(server_model_name(model_name, layout.slot_bytes), chunk_tokens)
        # uuid-derived like LMCache's own worker adapter: pids collide across containers.
        self.instance_id = uuid.uuid4().int & ((1 << 63) - 1)
        self._timeout = config.request_timeout_s
        self._breaker = breaker if breaker is not None else CircuitBreaker(2, config.heartbeat_s)
        # ZMQ's process-wide context, as LMCache's own adapters use: terminating a private one blocks
        # while requests to an unreachable server are queued.
        self.client = open_client(client_factory, config.url)
        self._lock = threading.Lock()
        self._up = False
        self._no_pool = False  # the server answers, without a pool (and holds this worker's registration)
        self.segment: Segment | None = None
        self.segment_lock = threading.Lock()
        self._stop = threading.Event()
        self._releases: queue.SimpleQueue[_Release | None] = queue.SimpleQueue()
        self._releaser = threading.Thread(
            target=self._release_in_order, name="kvcore-lmcache-releases", daemon=True
        )
        self._releaser.start()
        if not self._connect(config.connect_timeout_s, raise_mismatch=True) and not self._no_pool:
            log.warning(
                "kvcore: LMCache server %s did not answer within %.1fs; serving misses until it does "
                "(start it with `lmcache server --host 127.0.0.1 --port ... --supported-transfer-mode auto"
                " --shm-name ...`)",
                config.url,
                config.connect_timeout_s,
            )
        self._heartbeat = threading.Thread(target=self._beat, name="kvcore-lmcache-heartbeat", daemon=True)
        self._heartbeat.start()

    # -- health ------------------------------------------------------------------------------------

    def available(self) -> bool:
        """Whether calls may go to the server now (connected, breaker closed or probing)."""
        with self._lock:
            up = self._up
        return up and self._breaker.allow()

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._up

    def result(self, future: MessagingFuture[T], what: str, timeout: float | None = None) -> T:
        """The reply to one request, waited for at most the request timeout.

        Raises ``TransferTimeout`` on silence (and counts a failure), ``BackendError`` on an error reply.
        """
        try:
            value = future.result(timeout=self._timeout if timeout is None else timeout)
        except TimeoutError:
            self.failed(f"{what}: no reply within {self._timeout:.3f}s")
            raise TransferTimeout(f"LMCache {what}: no reply within {self._timeout:.3f}s") from None
        except Exception as exc:  # the client re-raises whatever the transport hit
            self.failed(f"{what}: {exc!r}")
            raise BackendError(f"LMCache {what} failed: {exc!r}") from exc
        self._breaker.record_success()
        return value

    def failed(self, why: str) -> None:
        """Count a failure; the link is down until the heartbeat sees the server again."""
        self._breaker.record_failure()
        if self._breaker.is_open:
            with self._lock:
                was_up, self._up = self._up, False
            if was_up:
                log.warning("kvcore: LMCache server %s marked down (%s)", self.config.url, why)

    def require(self) -> None:
        """Raise ``BackendUnavailable`` unless calls may go to the server now."""
        if not self.available():
            raise self.unavailable()

    def unavailable(self) -> BackendUnavailable:
        """Why calls may not go to the server now (``NoSharedMemoryPool`` if that is why)."""
        with self._lock:
            no_pool = self._no_pool
        if no_pool:
            return NoSharedMemoryPool(self.config.url)
        return BackendUnavailable(f"LMCache server {self.config.url} is unavailable")

    # -- server sessions and their clean-up --------------------------------------------------------

    def server_session(self, session: RequestId, tag: str) -> str:
        """A server session of one kvcore session: each lookup or job gets its own (``tag``), since a
        server session's lookup state and locks belong to its latest lookup. The link's own id keeps
        apart the ranks of one engine (same request ids, lookups and jobs in lockstep) and the engines
        of one server."""
        return f"kvcore:{self.instance_id:x}:{session}:{tag}"

    def release(
        self,
        server_session: str,
        chain: Sequence[ChunkKey],
        ranges: Iterable[tuple[int, int]],
        *,
        end: bool = True,
        taken_at: float | None = None,
        after: Sequence[MessagingFuture[Any]] = (),
    ) -> None:
        """Release the lookup locks a server session holds on chunk ranges ``[start, end)`` of ``chain``
        (the server releases only chunks that hit), then end that session unless ``end`` is false.

        Returns at once: a clean-up thread sends the releases in order and ends the session only once
        they are answered, since the server may run one client's requests out of order and a release
        after its session's end finds nothing to release. A lost release leaves a lock to the server's
        read-lock TTL. Locks taken (``taken_at``, monotonic) more than ``LOCK_TRUST_S`` ago are not
        released, only their session ended: they may have lapsed, and the server's counts are
        anonymous, so their release could take the lock of a reader that locked the chunk since.
        ``after``: requests of the same session sent outside the clean-up thread, waited for first.
        """
        if taken_at is not None and time.monotonic() - taken_at > LOCK_TRUST_S:
            ranges = ()
        keys = tuple(
            self.codec.ipc_key(server_session, chain, start, stop, None)
            for start, stop in ranges
            if start < stop
        )
        self._releases.put((keys, server_session if end else None, tuple(after)))

    def _release_in_order(self) -> None:
        while (task := self._releases.get()) is not None:
            keys, session, after = task
            for earlier in after:
                with contextlib.suppress(Exception):  # its outcome is its sender's to report
                    earlier.result(timeout=self._timeout)
            if not self.connected:
                continue  # a restarted server has no sessions; an unreachable one would only time out
            try:
                for future in [self.client.free_lookup_locks(key, 1) for key in keys]:
                    future.result(timeout=self._timeout)
                if session is not None:
                    self.client.end_session(session)
            except Exception as exc:  # silence or an error reply: the TTL takes over
                log.debug("kvcore: releasing %s on %s failed: %r", session, self.config.url, exc)

    # -- connecting --------------------------------------------------------------------------------

    def _connect(self, timeout: float, *, raise_mismatch: bool) -> bool:
        try:
            size = self.client.get_chunk_size().result(timeout=timeout)
            if size != self.chunk_tokens:
                raise ConfigError("chunk_tokens", self.chunk_tokens, f"the server's chunk size ({size})")
            if self._registers:
                self._register(timeout)
        except NoSharedMemoryPool as exc:
            self._pool_missing(exc)
            return False
        except ConfigError:
            if raise_mismatch:
                self.close()
                raise
            log.error("kvcore: LMCache server %s has a different chunk size; staying down", self.config.url)
            return False
        except Exception as exc:  # silence or a transport error: not connected yet
            log.debug("kvcore: connecting to %s failed: %r", self.config.url, exc)
            return False
        with self._lock:
            self._up, self._no_pool = True, False
        self._breaker.record_success()
        return True

    def _pool_missing(self, exc: NoSharedMemoryPool) -> None:
        """The server answered a registration without a pool: down until it has one, said once."""
        with self._lock:
            told, self._up, self._no_pool = self._no_pool, False, True
        if not told:
            log.warning("kvcore: %s; serving misses until it has one", exc)

    def _register(self, timeout: float) -> None:
        with self.segment_lock:
            segment = register_slots(
                self.config.url,
                self.client,
                self.instance_id,
                self.codec.model_name,
                self.chunk_tokens,
                self.layout.slot_bytes,
                timeout,
                self.segment,
            )
            if segment is not self.segment and self.segment is not None:
                self.segment.close()
            self.segment = segment

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            if self.connected:
                self._refresh()
            elif self._connect(self._timeout, raise_mismatch=False):
                log.warning("kvcore: LMCache server %s is reachable again", self.config.url)

    def _refresh(self) -> None:
        try:
            self.client.ping(self.instance_id).result(timeout=self._timeout)
            # Idempotent for a known worker; a restarted server learns the layout (and a new segment).
            if self._registers:
                self._register(self._timeout)
        except NoSharedMemoryPool as exc:  # restarted without one
            self._pool_missing(exc)
            return
        except Exception as exc:  # silence or an error reply: the server is gone or hung
            self.failed(f"heartbeat: {exc!r}")
            with self._lock:
                self._up = False
            return
        self._breaker.record_success()

    def close(self) -> None:
        """Stop the heartbeat, send the releases queued so far, unregister, unmap and close the socket.
        Each thread is joined for a bounded time (the heartbeat is at most two requests into a beat).
        Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if getattr(self, "_releaser", None) is not None and self._releaser.is_alive():
            self._releases.put(None)
            join(self._releaser, self._timeout + 1.0)
        if (
            getattr(self, "_heartbeat", None) is not None
            and self._heartbeat is not threading.current_thread()
        ):
            join(self._heartbeat, 2 * self._timeout + 1.0)
        with self._lock:
            registered = self._up or self._no_pool  # the server holds this worker's registration
        if self._registers and registered:
            try:  # waited for briefly, so that the socket is not closed under it
                self.client.unregister_kv_cache_engine_driven_context(self.instance_id).result(
                    timeout=min(self._timeout, 1.0)
                )
            except Exception as exc:  # the server reaps a silent worker anyway
                log.debug("kvcore: unregistering from %s failed: %r", self.config.url, exc)
        with self.segment_lock:
            if self.segment is not None:
                self.segment.close()
                self.segment = None
        with self._lock:
            self._up = self._no_pool = False
        self.client.close()


def join(thread: threading.Thread, timeout: float) -> None:
    """Join a (daemon) thread of the backend for at most ``timeout`` seconds; one still running then is
    left to end on its own, with a warning."""
    thread.join(timeout)
    if thread.is_alive():
        log.warning(
            "kvcore: thread %s still running %.1fs after close; left to end on its own", thread.name, timeout
        )
