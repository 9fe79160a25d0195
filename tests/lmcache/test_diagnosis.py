"""A real LMCache server started without ``--shm-name``: reachable, but with no shared-memory pool.

On the wire it accepts the worker's registration and answers it with an empty pool name and size 0 (it
would move values as pickled tensors, which kvcore never does). The backend says so once, in one warning
that names the server and the fix, and serves misses: lookups answer 0, saves are dropped, nothing waits
out a timeout, and closing withdraws the registration the server holds.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.jobs import JobResult
from kvcore.ports import StoreItem
from kvcore.scheduling.remote_lookup import PrefixLookup
from kvcore_lmcache import LMCacheChunkIndex, LMCacheManagedTier, NoSharedMemoryPool
from kvcore_lmcache.config import LMCacheMPConfig
from tests.lmcache.conftest import CHUNK_TOKENS, LMCacheServer, ServerFactory, new_shm_name

VALUE = 1024
SLOTS = 4
TIMEOUT_S = 2.0
BEAT_S = 0.05
FAST_S = 1.0
"""What a call may take against a server without a pool: it answers, so nothing waits out a timeout."""
REJOIN_S = 5.0


def _warning(url: str) -> str:
    return (
        f"kvcore: LMCache server {url} has no shared-memory pool (it was started without --shm-name), and "
        "kvcore moves KV only through one: restart it with `lmcache server ... --supported-transfer-mode "
        "auto --shm-name NAME`; serving misses until it has one"
    )


def _diagnoses(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("kvcore_lmcache") and "shared-memory pool" in r.getMessage()
    ]


def _keys(count: int) -> list[ChunkKey]:
    run = uuid.uuid4().hex[:8]
    return [ChunkKey(f"diagnosis/{run}/{i}") for i in range(count)]


class Worker:
    """A worker's tier (host buffer) and the scheduler's index of the same model, on one server."""

    def __init__(self, url: str) -> None:
        config = LMCacheMPConfig(
            url=url, request_timeout_s=TIMEOUT_S, heartbeat_s=BEAT_S, connect_timeout_s=TIMEOUT_S
        )
        model = f"diagnosis-{uuid.uuid4().hex[:8]}"
        self.host = bytearray(SLOTS * VALUE)
        self.tier = LMCacheManagedTier(
            config, self.host, value_bytes=VALUE, chunk_tokens=CHUNK_TOKENS, model_name=model
        )
        self.index = LMCacheChunkIndex(config, value_bytes=VALUE, chunk_tokens=CHUNK_TOKENS, model_name=model)

    def _job(self, submit: JobId) -> JobResult:
        (result,) = self.tier.wait([submit], 4 * TIMEOUT_S)
        return result

    def store(self, keys: list[ChunkKey]) -> JobResult:
        for i, key in enumerate(keys):
            self.host[i * VALUE : (i + 1) * VALUE] = key.encode().ljust(VALUE, b"v")
        items = [StoreItem(key, i * VALUE, VALUE) for i, key in enumerate(keys)]
        return self._job(self.tier.submit_store(RequestId("store"), items))

    def retrieve(self, keys: list[ChunkKey]) -> JobResult:
        session = RequestId(f"r-{uuid.uuid4().hex[:8]}")
        items = [StoreItem(key, i * VALUE, VALUE) for i, key in enumerate(keys)]
        try:
            return self._job(self.tier.submit_retrieve(session, items))
        finally:
            self.tier.end_session(session)

    def hits(self, keys: list[ChunkKey]) -> int:
        """The scheduler's answer, through the core's bounded lookup (a failure is 0)."""
        lookup = PrefixLookup(self.index, timeout_s=4 * TIMEOUT_S)
        try:
            pending = lookup.begin([[key] for key in keys])
            if isinstance(pending, int):
                return pending
            deadline = time.monotonic() + 4 * TIMEOUT_S
            while (answer := lookup.resume(pending)) is None:
                assert time.monotonic() < deadline, "a lookup outlived its timeout"
                time.sleep(0.002)
            return answer
        finally:
            lookup.close()

    def close(self) -> None:
        self.tier.close()
        self.index.close()


def _misses_quickly(worker: Worker) -> None:
    """Every kind of call misses at once, and says why where it reports an error."""
    keys = _keys(2)
    started = time.monotonic()
    with pytest.raises(NoSharedMemoryPool, match="no shared-memory pool"):
        worker.tier.submit_lookup(RequestId("lookup"), keys)
    saved = worker.store(keys)
    assert saved.failed == (0, 1)
    assert "no shared-memory pool" in (saved.error or "")
    assert worker.retrieve(keys).failed == (0, 1)
    assert worker.hits(keys) == 0
    assert time.monotonic() - started < FAST_S


def test_a_server_without_a_pool_is_one_clear_warning_and_misses(
    server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvcore_lmcache")
    server = server_factory(shared_memory=False)
    server.start()
    threads = set(threading.enumerate())
    started = time.monotonic()
    worker = Worker(server.url)
    try:
        assert time.monotonic() - started < FAST_S  # it answered: no connect timeout waited out
        assert _diagnoses(caplog) == [_warning(server.url)]
        assert not [r for r in caplog.records if "did not answer" in r.getMessage()]
        assert not worker.tier.link.connected
        # the server holds the registration it answered (kvcore never moves a pickled tensor)
        assert worker.tier.link.instance_id in server.registered()

        # many heartbeats (each re-registers) and calls later: still the one warning
        for _ in range(10):
            _misses_quickly(worker)
            time.sleep(2 * BEAT_S)
        assert _diagnoses(caplog) == [_warning(server.url)]
        assert worker.tier.link.instance_id in server.registered()  # kept alive by the heartbeat
    finally:
        started = time.monotonic()
        worker.close()
    assert time.monotonic() - started < FAST_S
    assert not [t.name for t in set(threading.enumerate()) - threads if t.name.startswith("kvcore-")]
    assert worker.tier.link.instance_id not in server.registered()  # withdrawn on close


def test_a_restart_with_a_pool_joins_and_one_without_is_said_again(
    server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvcore_lmcache")
    server: LMCacheServer = server_factory(shared_memory=False)
    server.start()
    worker = Worker(server.url)
    try:
        assert len(_diagnoses(caplog)) == 1

        server.shm_name = new_shm_name()  # the operator follows the advice
        server.restart()
        keys = _keys(2)
        deadline = time.monotonic() + REJOIN_S
        while not worker.store(keys).ok:
            assert time.monotonic() < deadline, "the worker never joined the server with a pool"
            time.sleep(BEAT_S)
        assert worker.retrieve(keys).ok
        assert worker.hits(keys) == 2

        server.kill()
        server.shm_name = None  # restarted without one again: a new episode, said once more
        server.start()
        deadline = time.monotonic() + REJOIN_S
        while len(_diagnoses(caplog)) < 2:
            assert time.monotonic() < deadline, "a pool lost on restart was never diagnosed"
            time.sleep(BEAT_S)
        _misses_quickly(worker)
        time.sleep(10 * BEAT_S)
        assert _diagnoses(caplog) == [_warning(server.url)] * 2
    finally:
        worker.close()
