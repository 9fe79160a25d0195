"""A connector hook that reaches the half of the connector its process does not run is a usage error."""

from __future__ import annotations

import pytest

from kvcore.errors import InvalidSpecError
from kvcore_vllm.roles import require_side


def test_the_half_this_process_runs_is_returned() -> None:
    side = object()
    assert require_side(side, "worker") is side


def test_a_hook_of_the_other_half_names_both_roles() -> None:
    with pytest.raises(InvalidSpecError, match="worker-side hook called on a scheduler-side connector"):
        require_side(None, "worker")
    with pytest.raises(InvalidSpecError, match="scheduler-side hook called on a worker-side connector"):
        require_side(None, "scheduler")
