"""``MooncakeClient``: the one place that calls ``mooncake.store.MooncakeDistributedStore``.

The native client has three sharp edges this module exists to blunt: a call on a client that is not set
up, or already closed, crashes the process (so every call goes through a guard that refuses it with
``BackendUnavailable``); ``setup`` against a missing master blocks for about 90 s (so the master's port
is probed first, within ``setup_timeout_s``, and setup's retries are capped); ``close`` blocks for about
11 s when the master is gone (so a client whose last call found the master unreachable is not closed).
``setup`` and ``close`` hold the GIL for their whole duration, which is why neither is bounded with a
helper thread: the bound must come from not making the call.
Errors come back as negative return codes; ``describe`` and ``Code`` name them for the callers, which
decide what a code means for their port (a miss, a dropped save, an error).

The data calls (``batch_*``) release the GIL and may run concurrently on several threads; the guard
only makes sure that none is in progress when the client closes.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from kvcore.errors import BackendUnavailable, ConfigError
from kvcore_mooncake.config import MooncakeStoreConfig

if TYPE_CHECKING:
    from mooncake.store import ReplicateConfig

__all__ = ["INSTALL", "Code", "MooncakeClient", "describe", "master_address"]

log = logging.getLogger(__name__)

_SECONDS_PER_SETUP_TRY = 4.5
"""Measured: one failed connection attempt of ``setup`` (0.3.13) takes about 4.5 s."""


class Code(enum.IntEnum):
    """The Mooncake return codes kvcore acts on (``mooncake-store`` ``ErrorCode``)."""

    OK = 0
    ERROR = -1
    NO_SPACE = -200
    INVALID_PARAMS = -600
    NOT_FOUND = -704
    EXISTS = -705
    LEASED = -706
    TRANSFER_FAILED = -800
    RPC_FAILED = -900


_MEANING = {
    Code.ERROR: "error",
    Code.NO_SPACE: "no space in any segment",
    Code.INVALID_PARAMS: "invalid parameters (or a buffer smaller than the value)",
    Code.NOT_FOUND: "not found",
    Code.EXISTS: "already exists",
    Code.LEASED: "leased by a reader",
    Code.TRANSFER_FAILED: "transfer failed",
    Code.RPC_FAILED: "master unreachable (RPC failed)",
}


def describe(code: int) -> str:
    """A short human reading of a return code, e.g. ``-704 (not found)``."""
    try:
        meaning = _MEANING[Code(code)]
    except (ValueError, KeyError):
        meaning = "unknown code"
    return f"{code} ({meaning})"


class StoreBinding(Protocol):
    """The part of the native ``MooncakeDistributedStore`` this module calls (a fake may stand in)."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...

    def close(self) -> int: ...

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig
    ) -> list[int]: ...

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: ReplicateConfig,
    ) -> list[int]: ...

    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def batch_remove(self, keys: list[str], force: bool) -> list[int]: ...

    def remove_all(self, force: bool) -> int: ...


INSTALL = "install mooncake-transfer-engine-non-cuda (or the CUDA build on GPU machines) and libibverbs1"
"""What to install where the client does not import."""


def _native() -> StoreBinding:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise BackendUnavailable(f"mooncake.store does not import ({exc}): {INSTALL}") from None
    if not hasattr(MooncakeDistributedStore, "batch_get_into_multi_buffers"):
        raise BackendUnavailable(
            "mooncake.store has no multi-buffer transfers (batch_put_from_multi_buffers, batch_get_into_"
            f"multi_buffers), which a value per KV head needs: Mooncake 0.3.13 or later; {INSTALL}"
        )
    return MooncakeDistributedStore()


def _replicas(count: int) -> ReplicateConfig:
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = count
    return config


def master_address(master: str) -> tuple[str, int]:
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("master", master, "'host:port' of the Mooncake master")
    return host.strip("[]"), int(port)


class MooncakeClient:
    """A set-up Mooncake store client, guarded: after ``close`` every call raises ``BackendUnavailable``.

    Build it with ``connect``. It contributes ``segment_size`` bytes to the shared pool (0: a pure
    client that holds no data). Methods return the native codes, one per key; callers map them.
    """

    def __init__(self, native: StoreBinding, master: str, segment_size: int, replicas: int) -> None:
        self._native = native
        self.master = master
        self.segment_size = segment_size
        self._replicate = _replicas(replicas)
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False
        self._registered: set[tuple[int, int]] = set()
        self._unreachable = False  # the last data call answered RPC_FAILED

    @classmethod
    def connect(
        cls,
        config: MooncakeStoreConfig,
        *,
        segment_size: int | None = None,
        binding: Callable[[], StoreBinding] = _native,
    ) -> MooncakeClient:
        """Set up a client against ``config.master`` within ``config.setup_timeout_s`` seconds.

        ``segment_size`` overrides ``config.segment_size`` (0 for a pure client, as the scheduler's index
        uses). Raises ``BackendUnavailable`` naming the master when nothing listens at its address (at
        once; or after ``setup_timeout_s`` when the host does not answer) or ``setup`` fails.
        """
        size = config.segment_size if segment_size is None else segment_size
        if size < 0:
            raise ConfigError("segment_size", size, "a size >= 0")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        tries = max(1, int(config.setup_timeout_s // _SECONDS_PER_SETUP_TRY))
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(tries))
        # Read by the native client of each process as it sets up: the first config of a process bounds
        # every client's calls to the master (an operator's own MC_RPC_TIMEOUT_MS wins).
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, round(config.rpc_timeout_s * 1000))))
        host, port = master_address(config.master)
        # A master that is not listening fails here at once, instead of after setup's retries.
        try:
            socket.create_connection((host, port), timeout=config.setup_timeout_s).close()
        except OSError as exc:
            raise BackendUnavailable(f"Mooncake master {config.master} is not reachable: {exc}") from None
        native = binding()
        # A master that accepts connections but never answers still holds this call for the RPC
        # timeout per try (rpc_timeout_s): not boundable otherwise from Python (the GIL is held).
        code = native.setup(
            config.local_hostname,
            config.metadata,
            size,
            config.transfer_buffer_size,
            config.protocol,
            config.devices,
            config.master,
        )
        if code != 0:
            raise BackendUnavailable(
                f"Mooncake setup against master {config.master} failed with code {describe(code)} "
                f"(local_hostname={config.local_hostname!r}, protocol={config.protocol!r}, "
                f"segment_size={size})"
            )
        return cls(native, config.master, size, config.replicas)

    @contextmanager
    def _guard(self) -> Iterator[StoreBinding]:
        with self._cond:
            if self._closed:
                raise BackendUnavailable(f"the Mooncake client of master {self.master} is closed")
            self._active += 1
        try:
            yield self._native
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def _note(self, codes: list[int]) -> list[int]:
        self._unreachable = Code.RPC_FAILED in codes
        return codes

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def register_buffer(self, address: int, length: int) -> None:
        """Register host memory for zero-copy puts and gets, for the client's lifetime.

        Registering the same range again does nothing (Mooncake itself refuses it with -600), so that
        several stores may share one client and buffer. Raises ``BackendUnavailable`` on failure.
        """
        with self._guard() as native, self._cond:
            if (address, length) in self._registered:
                return
            code = native.register_buffer(address, length)
            if code == 0:
                self._registered.add((address, length))
        if code != 0:
            raise BackendUnavailable(f"registering {length} bytes at {address:#x} failed: {describe(code)}")

    def put_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        """Store each key's bytes from registered memory; per key 0 or a negative code."""
        with self._guard() as native:
            return self._note(native.batch_put_from(keys, addresses, sizes, self._replicate))

    def get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        """Copy each key's value into registered memory; per key the bytes read or a negative code."""
        with self._guard() as native:
            return self._note(native.batch_get_into(keys, addresses, sizes))

    def put_from_parts(
        self, keys: list[str], addresses: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        """Store each key's value gathered from its parts in registered memory; per key 0 or a negative
        code."""
        with self._guard() as native:
            return self._note(native.batch_put_from_multi_buffers(keys, addresses, sizes, self._replicate))

    def get_into_parts(
        self, keys: list[str], addresses: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        """Scatter each key's value into its parts in registered memory; per key the bytes read or a
        negative code."""
        with self._guard() as native:
            return self._note(native.batch_get_into_multi_buffers(keys, addresses, sizes))

    def exist(self, keys: list[str]) -> list[int]:
        """Per key 1 (present), 0 (absent) or a negative code."""
        with self._guard() as native:
            return self._note(native.batch_is_exist(keys))

    def remove(self, keys: list[str]) -> list[int]:
        """Remove keys that no reader holds a lease on; per key 0 or a negative code."""
        with self._guard() as native:
            return self._note(native.batch_remove(keys, False))

    def remove_all(self) -> int:
        """Remove every object of the pool, leased or not; the count removed or a negative code."""
        with self._guard() as native:
            return native.remove_all(True)

    def close(self, timeout: float = 5.0) -> None:
        """Refuse new calls, wait for those in progress (at most ``timeout``), close the native client.

        Idempotent. The native client is left open, with a warning, when calls are still running after
        ``timeout`` (closing under them would crash) or when the last call found the master unreachable
        (the native close would then freeze the whole process for about 11 s); the OS reclaims it.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._closed:
                return
            self._closed = True
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            busy = self._active
        if busy or self._unreachable:
            why = f"{busy} calls still running after {timeout:.1f}s" if busy else "master unreachable"
            log.warning("kvcore: Mooncake client of master %s left open: %s", self.master, why)
            return
        self._native.close()
