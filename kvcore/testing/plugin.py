"""The ``pytest11`` entry point of kvcore: registers the conformance suite's marker, nothing else."""

from __future__ import annotations

import pytest

__all__ = ["pytest_configure"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvcore_conformance: a test from the kvcore conformance suite")
