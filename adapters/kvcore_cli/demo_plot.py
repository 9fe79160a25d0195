"""``kvcore demo --plot FILE.png``: the demo's run in one picture, drawn with matplotlib (imported only here,
and only when asked for: the demo itself does not need it).

Top: per turn, the prompt tokens the engine computes without kvcore beside those it computes with kvcore
and those kvcore served. Bottom: over the run, request by request, the share of prompt tokens served
from kvcore so far and the bytes kvcore's pool holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore.errors import UsageError
from kvcore_cli.demo import DemoSummary, GiB

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["figure_class", "plot_demo"]


def figure_class() -> type[Figure]:
    """matplotlib's ``Figure``; raises ``UsageError`` naming the missing package when it is not installed
    (call it before a long run, so that ``--plot`` fails at once)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(
            "--plot draws with matplotlib, which is not installed: pip install matplotlib"
        ) from None
    return Figure


def plot_demo(summary: DemoSummary, path: str) -> None:
    """Draw ``summary`` into the PNG file ``path``."""
    figure = figure_class()(figsize=(10, 8), layout="constrained")
    turns_ax, time_ax = figure.subplots(2, 1)
    turns = summary.per_turn
    x = [t.turn for t in turns]
    kilo = [1e-3 * t.prompt_tokens for t in turns]
    computed = [1e-3 * t.computed_tokens for t in turns]
    served = [1e-3 * t.served_tokens for t in turns]
    width = 0.38
    turns_ax.bar([n - width / 2 for n in x], kilo, width, color="0.6", label="computed, without kvcore")
    with_x = [n + width / 2 for n in x]
    turns_ax.bar(with_x, computed, width, color="tab:orange", label="computed, with kvcore")
    turns_ax.bar(with_x, served, width, bottom=computed, color="tab:blue", label="served from kvcore")
    turns_ax.set_xticks(x, [f"turn {n}" for n in x])
    turns_ax.set_ylabel("prompt tokens (thousands)")
    turns_ax.set_title("Prompt tokens per turn of every conversation: computed without and with kvcore")
    turns_ax.legend(loc="upper left")

    requests = summary.requests
    number = range(1, len(requests) + 1)
    share, prompt, served_so_far = [], 0, 0
    for r in requests:
        prompt += r.prompt_tokens
        served_so_far += r.served_tokens
        share.append(100 * served_so_far / prompt)
    (share_line,) = time_ax.plot(
        number, share, color="tab:blue", label="prompt tokens served from kvcore so far"
    )
    for n, r in enumerate(requests, start=1):
        if n == 1 or r.turn != requests[n - 2].turn:
            time_ax.axvline(n - 0.5, color="0.8", linewidth=0.8)
            time_ax.text(n, 94, f"turn {r.turn}", color="0.4")
    time_ax.set_ylim(0, 100)
    time_ax.set_xlabel("requests, in the order served")
    time_ax.set_ylabel("% of prompt tokens")
    chunk = summary.workload.chunk_bytes / GiB
    pool_ax = time_ax.twinx()
    used = [r.pool_used_chunks * chunk for r in requests]
    (pool_line,) = pool_ax.step(number, used, color="tab:green", where="post", label="kvcore pool used")
    size = pool_ax.axhline(summary.pool_capacity * chunk, color="tab:green", linestyle="--", linewidth=0.8)
    size.set_label("kvcore pool size")
    pool_ax.set_ylim(0, summary.pool_capacity * chunk * 1.1)
    pool_ax.set_ylabel("GiB")
    time_ax.set_title(f"Over the run ({summary.evictions:,} chunks evicted from the pool)")
    time_ax.legend(handles=[share_line, pool_line, size], loc="lower right")

    w = summary.workload
    o = w.options
    figure.suptitle(
        f"kvcore demo: {o.chats} conversations x {o.turns} turns; {w.kv_bytes_per_token >> 10:,} KiB of KV a "
        f"token; engine {w.engine_bytes / GiB:.2f} GiB; pool {w.pool_bytes / GiB:.2f} GiB; "
        f"{o.chunk_tokens}-token chunks"
    )
    figure.savefig(path, format="png", dpi=100)
