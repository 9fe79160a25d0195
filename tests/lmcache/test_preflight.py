"""The LMCache backend's pre-flight against a real server: it answers, so nothing is said but that; a
server that is gone is a warning, and the engine's own link to it, built then, starts and misses."""

from __future__ import annotations

from kvcore.plugins.preflight import Verdict, preflight
from tests.lmcache.conftest import LMCacheServer, ServerFactory


def _data(url: str) -> dict[str, object]:
    return {"backend": {"kind": "lmcache_mp", "url": url}}


def test_a_server_that_answers_passes(lmcache_server: LMCacheServer) -> None:
    report = preflight(_data(lmcache_server.url), memory=None, timeout_s=2.0)
    assert not report.refusals
    assert not report.warnings
    assert [(f.field, f.verdict) for f in report.findings if f.check == "server"] == [
        ("backend.url", Verdict.OK)
    ]


def test_a_server_gone_is_a_warning(server_factory: ServerFactory) -> None:
    server = server_factory()  # made, never started: its port is free
    report = preflight(_data(server.url), memory=None, timeout_s=2.0)
    assert not report.refusals
    assert [w.field for w in report.warnings] == ["backend.url"]
