"""``MooncakeChunkStore``: the ``ChunkStore`` port on a Mooncake distributed store.

One host buffer is registered with the client once, at construction; every ``StoreItem`` names bytes of
it, and puts and gets move those bytes zero-copy (``batch_put_from`` / ``batch_get_into``; a batch with
runs, one value per KV head, ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``) on a
``JobLane``, so ``submit_*`` return at once. Gets are reads and run before queued puts: a request waits
on a get, while a put only has to finish before its host slot is reused. Fault hooks, if given, run
before each batch (``kvcore.kit.faults``).

Semantics chosen, and why:

- **Re-put keeps the stored value.** Keys are content addresses (namespace + shard + chunk hash), so an
  equal key means equal bytes; Mooncake's ``put`` on a present key returns success and keeps the old
  value, which is the port's idempotence and costs no transfer. ``upsert`` is never used: nothing in
  kvcore replaces a value in place (a new weights epoch gives new keys).
- **Reads take leases.** Each get leases its objects on the master (``--default_kv_lease_ttl``, 10 s by
  default) so that no one frees them mid-read. ``remove`` never forces past a lease (a reader in another
  process would read recycled memory): it retries leased keys until ``remove_timeout_s`` and then raises.
- **A dead master costs little.** Calls fail with -900 after about 4 s each; three such failures in a row
  open a circuit breaker, and while it is open jobs fail at once (gets miss, puts are dropped) until a
  probe goes through. A restarted master is rejoined by the native client on its own (its keys are gone).
- **clear** (tests, operators) removes every object of the pool, leased or not, and dooms the jobs
  queued before it, so that no put in flight resurrects a cleared value.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence

from kvcore.errors import BackendError, BackendUnavailable, InvalidSpecError
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobResult
from kvcore.kit.faults import FaultHooks, leading_failures
from kvcore.kit.health import CircuitBreaker
from kvcore.kit.lane_store import LaneStore, StoreJob
from kvcore.ports import Direction, StoreItem
from kvcore_mooncake.client import Code, MooncakeClient, describe
from kvcore_mooncake.config import MooncakeStoreConfig

__all__ = ["MooncakeChunkStore"]

log = logging.getLogger(__name__)

_REMOVE_RETRY_S = 0.02
_QUIET = frozenset({Code.NOT_FOUND, Code.NO_SPACE})
"""Codes that are ordinary outcomes (a miss, a full pool): no warning. Anything else is logged."""


class MooncakeChunkStore(LaneStore):
    """The ``ChunkStore`` port (and ``SupportsClear``) over one registered host buffer.

    Build it from a set-up ``MooncakeClient`` and the buffer (``buffer_address``, ``buffer_length``),
    which the caller owns and keeps alive until ``close``; or with ``open``, which also sets up (and
    then owns) the client. The registration lives as long as the client. ``faults`` (``kvcore.kit.faults``)
    run on the job thread before each batch. Jobs run as every lane store runs them
    (``kvcore.kit.lane_store``).
    """

    def __init__(
        self,
        client: MooncakeClient,
        buffer_address: int,
        buffer_length: int,
        *,
        owns_client: bool = False,
        remove_timeout_s: float = 12.0,
        breaker: CircuitBreaker | None = None,
        faults: FaultHooks | None = None,
    ) -> None:
        if buffer_length < 1:
            raise InvalidSpecError(f"buffer_length: got {buffer_length}, expected at least 1 byte")
        client.register_buffer(buffer_address, buffer_length)
        super().__init__("Mooncake store", buffer_length)
        self._client = client
        self._owns_client = owns_client
        self._base = buffer_address
        self._remove_timeout = remove_timeout_s
        self._breaker = breaker if breaker is not None else CircuitBreaker(threshold=3, backoff_s=2.0)
        self._faults = faults

    @classmethod
    def open(cls, config: MooncakeStoreConfig, buffer_address: int, buffer_length: int) -> MooncakeChunkStore:
        """Set up a client from ``config`` (contributing ``config.segment_size``) and register the buffer.

        Raises ``BackendUnavailable`` when the master cannot be reached within ``setup_timeout_s``.
        """
        client = MooncakeClient.connect(config)
        try:
            return cls(client, buffer_address, buffer_length, owns_client=True)
        except BaseException:
            client.close()
            raise

    # -- the port ------------------------------------------------------------------------------------

    def exists(self, keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
        """Which keys are present. Raises ``BackendError`` (nothing changed) when the master fails.

        While the breaker is open this raises ``BackendUnavailable`` at once; otherwise a dead master
        holds the call for Mooncake's RPC timeout (about 4 s).
        """
        if not keys:
            return ()
        if not self._breaker.allow():
            raise BackendUnavailable(f"Mooncake master {self._client.master} is marked unhealthy")
        try:
            codes = self._client.exist(list(keys))
        except BackendError:
            self._breaker.record_failure()
            raise
        if len(codes) != len(keys) or any(c not in (0, 1) for c in codes):
            self._breaker.record_failure()
            raise BackendError(f"exists of {len(keys)} keys answered {_summary(codes)}")
        self._breaker.record_success()
        return tuple(c == 1 for c in codes)

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        """Store the items' host bytes under their keys. A present key keeps its value.

        Raises ``InvalidSpecError`` (nothing queued) for bytes outside the buffer, ``UsageError`` once
        closed. Failed items (no space, master down, transfer error) are absent or keep their earlier
        value: Mooncake makes an object visible only once all of its bytes arrived.
        """
        return super().submit_put(items)

    def submit_get(self, items: Sequence[StoreItem]) -> JobId:
        """Copy the keys' values into the items' host bytes. A missing key, or a value of another length
        than the item's, is a failed item (a miss): its host bytes are undefined."""
        return super().submit_get(items)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """Drop keys; missing ones are ignored. A key a reader leased is retried until its lease ends.

        Raises ``BackendError`` when the master fails, or when keys are still leased after
        ``remove_timeout_s``; the keys not yet removed remain.
        """
        pending: list[str] = list(dict.fromkeys(keys))
        deadline = time.monotonic() + self._remove_timeout
        while pending:
            codes = self._client.remove(pending)
            if len(codes) != len(pending):
                raise BackendError(f"remove of {len(pending)} keys answered {len(codes)} codes")
            leased = [k for k, c in zip(pending, codes, strict=True) if c == Code.LEASED]
            failed = [c for c in codes if c not in (Code.OK, Code.NOT_FOUND, Code.LEASED)]
            if failed:
                raise BackendError(f"remove of {len(pending)} keys failed: {_summary(failed)}")
            if leased and time.monotonic() >= deadline:
                raise BackendError(
                    f"{len(leased)} keys still leased by readers after {self._remove_timeout:.1f}s, "
                    f"e.g. {leased[0]!r}"
                )
            pending = leased
            if pending:
                time.sleep(_REMOVE_RETRY_S)

    def clear(self) -> None:
        """Drop every object of the pool (every instance's, leased or not) and fail the jobs queued
        before the call. A job already running finishes first. Raises ``BackendError`` on failure."""
        with self._io:
            self._clear_queued()
            removed = self._client.remove_all()
        if removed < 0:
            raise BackendError(f"remove_all failed: {describe(removed)}")

    def _closed_lane(self, timeout: float) -> None:
        """Close an owned client (bounded by ``timeout``)."""
        if self._owns_client:
            self._client.close(timeout)

    # -- the worker ----------------------------------------------------------------------------------

    def _transfer(self, put: bool, items: list[StoreItem]) -> list[int]:
        """Run one batch on the worker thread and return the native code of each item; the leading items
        the fault hooks fail answer ``TRANSFER_FAILED`` without moving. Items of one range move with
        Mooncake's single-buffer calls, a batch with runs (a value per KV head) with its multi-buffer
        ones."""
        failed = leading_failures(self._faults, Direction.SAVE if put else Direction.LOAD, len(items))
        codes = [int(Code.TRANSFER_FAILED)] * failed
        rest = items[failed:]
        if not rest:
            return codes
        keys: list[str] = [item.key for item in rest]
        if any(item.runs for item in rest):
            addresses = [[self._base + offset for offset, _ in item.ranges()] for item in rest]
            sizes = [[length for _, length in item.ranges()] for item in rest]
            parts = self._client.put_from_parts if put else self._client.get_into_parts
            codes.extend(parts(keys, addresses, sizes))
        else:
            transfer = self._client.put_from if put else self._client.get_into
            codes.extend(transfer(keys, [self._base + i.offset for i in rest], [i.length for i in rest]))
        return codes

    def _run(self, job: StoreJob) -> JobResult:
        if not self._breaker.allow():
            return job.failed(f"Mooncake master {self._client.master} is marked unhealthy")
        codes = [int(Code.ERROR)] * len(job.items)
        # Mooncake answers a key twice in one batch but copies it once: repeats go in later rounds.
        for round_ in _rounds(job.items):
            try:
                answered = self._transfer(job.put, [job.items[i] for i in round_])
            except BackendError as exc:
                self._breaker.record_failure()
                return job.failed(str(exc))
            if len(answered) != len(round_):
                self._breaker.record_failure()
                return job.failed(f"{len(round_)} items answered {len(answered)} codes")
            for i, code in zip(round_, answered, strict=True):
                codes[i] = code
        if Code.RPC_FAILED in codes:
            self._breaker.record_failure()
        else:
            self._breaker.record_success()
        if job.put:
            failed = tuple(i for i, c in enumerate(codes) if c not in (Code.OK, Code.EXISTS))
        else:
            failed = tuple(
                i for i, (c, it) in enumerate(zip(codes, job.items, strict=True)) if c != it.length
            )
        if not failed:
            return JobResult(job.job_id)
        bad = [codes[i] for i in failed]
        why = f"{len(failed)} of {len(codes)} {'puts' if job.put else 'gets'} failed: {_summary(bad)}"
        if any(c not in _QUIET for c in bad):
            log.warning("kvcore: Mooncake %s", why)
        return JobResult(job.job_id, failed, why)


def _rounds(items: Sequence[StoreItem]) -> list[list[int]]:
    """Item indices split into batches without a repeated key, in order (one batch when none repeats)."""
    rounds: list[list[int]] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        n = seen[item.key] = seen.get(item.key, -1) + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)
    return rounds


def _summary(codes: Sequence[int]) -> str:
    """``-704 (not found) x2, 12 (12 bytes)``: each distinct answer once, with its count."""
    parts = []
    for code, count in collections.Counter(codes).most_common():
        text = describe(code) if code < 0 else f"{code} ({code} bytes)"
        parts.append(text if count == 1 else f"{text} x{count}")
    return ", ".join(parts)
