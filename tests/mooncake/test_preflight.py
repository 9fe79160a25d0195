"""The Mooncake store's pre-flight against a real master: it answers, so the engine would start; once the
master is gone, the pre-flight refuses as the engine's own client does (``BackendUnavailable`` naming
the master)."""

from __future__ import annotations

import pytest

from kvcore.errors import BackendUnavailable
from kvcore.plugins.preflight import Verdict, preflight
from kvcore_mooncake.client import MooncakeClient
from tests.mooncake.conftest import Master, MasterFactory, config_for


def _data(master: str) -> dict[str, object]:
    return {"backend": {"kind": "mooncake_store", "master": master, "local_size": "64MiB"}}


def test_a_master_that_listens_passes(master: Master) -> None:
    report = preflight(_data(master.address), memory=None, timeout_s=2.0)
    assert not report.refusals
    servers = [f for f in report.findings if f.check == "server"]
    assert [(f.field, f.verdict) for f in servers] == [("backend.master", Verdict.OK)]
    assert next(f.text for f in report.findings if f.check == "dependency").startswith("client mooncake")


def test_a_master_gone_is_refused_by_both(master_factory: MasterFactory) -> None:
    gone = master_factory()
    address = gone.address
    gone.stop()
    (refusal,) = preflight(_data(address), memory=None, timeout_s=2.0).refusals
    assert (refusal.field, refusal.value) == ("backend.master", address)
    with pytest.raises(BackendUnavailable, match=address):
        MooncakeClient.connect(config_for(address, setup_timeout_s=2.0), segment_size=0)
