"""Property tests of the engine-facing API's input checks: whatever a caller passes to ``CacheScheduler``
(constructor, ``lookup``, ``start_load``, ``save``), the plan values (``BlockOp``, ``StepPlan``,
``OpReport``, ``BlockTransfer``) or ``ExtraKeys`` / ``MMSpan``, the answer is a result or a ``UsageError``
whose message names the argument — never another exception, and a refused call changes nothing."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcore.config import load_config
from kvcore.errors import UsageError
from kvcore.ids import RequestId
from kvcore.keying.hashing import ExtraKeys, MMSpan
from kvcore.model.step import BlockOp, OpReport, StepPlan
from kvcore.ports import BlockTransfer, Direction
from kvcore.scheduling.scheduler import CacheScheduler
from tests.unit.test_scheduler import ENGINE, TOKENS

CONFIG = load_config({"backend": {"kind": "cpu", "size": 1 << 20}, "chunk_tokens": 8})

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=6) | st.tuples(inner, inner), max_leaves=12
)
block_tables = st.one_of(values, st.lists(st.one_of(st.none(), st.integers(-3, 70)), max_size=12))


def _refusal(exc: BaseException, *names: str) -> None:
    assert isinstance(exc, UsageError), f"{type(exc).__name__}: {exc}"
    assert any(name in str(exc) for name in names), f"{exc} names none of {names}"


def _quiet(sched: CacheScheduler) -> tuple[int, int, int]:
    stats = sched.stats()
    return stats.requests, stats.ops_in_flight, stats.pool.pinned


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.one_of(values, st.lists(st.integers(-5, 2**33), max_size=40)),
    block_hashes=st.one_of(values, st.lists(st.binary(min_size=0, max_size=33), max_size=10)),
    hash_block_tokens=values,
    num_tokens=values,
    local_tokens=values,
    which=st.sampled_from(["tokens", "hashes", "both", "neither"]),
)
def test_lookup_answers_or_refuses_naming_the_argument(
    tokens: Any, block_hashes: Any, hash_block_tokens: Any, num_tokens: Any, local_tokens: Any, which: str
) -> None:
    sched = CacheScheduler(CONFIG, ENGINE, 8)
    kwargs: dict[str, Any] = {"local_tokens": local_tokens}
    if which in ("tokens", "both"):
        kwargs["tokens"] = tokens
    if which in ("hashes", "both"):
        kwargs.update(block_hashes=block_hashes, hash_block_tokens=hash_block_tokens, num_tokens=num_tokens)
    try:
        hits = sched.lookup(RequestId("r"), **kwargs)
    except Exception as exc:
        _refusal(
            exc, "tokens", "block_hashes", "hash_block_tokens", "num_tokens", "local_tokens", "token ids"
        )
        assert _quiet(sched) == (0, 0, 0)
    else:
        assert hits is not None
        assert hits >= 0


@settings(max_examples=300, deadline=None)
@given(blocks=block_tables, num_tokens=values, tokens=values)
@example(blocks=[], num_tokens=32, tokens=True)  # once a TypeError out of the keyer
def test_save_and_start_load_queue_or_refuse_naming_the_argument(
    blocks: Any, num_tokens: Any, tokens: Any
) -> None:
    sched = CacheScheduler(CONFIG, ENGINE, 8)
    rid = RequestId("r")
    assert sched.lookup(rid, tokens=TOKENS) == 0
    try:
        sched.save(rid, blocks, num_tokens=num_tokens, tokens=tokens)
    except Exception as exc:
        _refusal(exc, "block_ids", "num_tokens", "tokens", "token ids")
        assert sched.stats().ops_in_flight == 0
    try:
        sched.start_load(rid, blocks)
    except Exception as exc:
        _refusal(exc, "block_ids")


@settings(max_examples=200, deadline=None)
@given(num_slots=values, world_size=values)
@example(
    num_slots=2**62, world_size=1
)  # once a list of every slot number: the test process ran out of memory
def test_the_scheduler_constructor_refuses_naming_the_argument(num_slots: Any, world_size: Any) -> None:
    try:
        CacheScheduler(CONFIG, ENGINE, num_slots, world_size=world_size)
    except Exception as exc:
        _refusal(exc, "num_slots", "world_size")


@settings(max_examples=200, deadline=None)
@given(salt=values, lora=values, mm=values, offset=values, length=values, mm_hash=values)
def test_extra_keys_refuse_naming_the_field(
    salt: Any, lora: Any, mm: Any, offset: Any, length: Any, mm_hash: Any
) -> None:
    try:
        ExtraKeys(cache_salt=salt, lora_id=lora, mm=mm)
    except Exception as exc:
        _refusal(exc, "cache_salt", "lora_id", "mm")
    try:
        MMSpan(mm_hash=mm_hash, offset=offset, length=length)
    except Exception as exc:
        _refusal(exc, "mm_hash", "offset", "length")


@settings(max_examples=200, deadline=None)
@given(engine=values, host=values, fenced=values, failed=values)
def test_plan_values_refuse_non_integer_ids_naming_the_field(
    engine: Any, host: Any, fenced: Any, failed: Any
) -> None:
    for build, names in (
        (lambda: BlockOp(1, Direction.SAVE, engine, host), ("engine_blocks", "host_blocks")),
        (lambda: BlockTransfer(Direction.LOAD, engine, host), ("engine_blocks", "host_blocks")),
        (lambda: StepPlan((), (), fenced), ("fenced",)),
        (lambda: OpReport(1, 0, failed), ("failed",)),
    ):
        try:
            build()
        except Exception as exc:
            _refusal(exc, *names)
