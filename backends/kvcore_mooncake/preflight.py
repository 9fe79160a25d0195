"""The Mooncake store's pre-flight (``kvcore.plugins.preflight``): the client library, the master (the
engine refuses to start when nothing listens there: so does this) and the metadata server, each asked
within the pre-flight's bound, nothing opened."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterator
from urllib.parse import urlsplit

from kvcore.kit.probe import probe_tcp
from kvcore.plugins.preflight import Finding, PreflightContext, Verdict
from kvcore_mooncake.client import INSTALL, master_address
from kvcore_mooncake.config import MooncakeStoreConfig

__all__ = ["mooncake_findings"]


def mooncake_findings(settings: MooncakeStoreConfig, context: PreflightContext) -> Iterator[Finding]:
    """Every finding about a Mooncake store's settings under ``context.field``."""
    field = context.field
    if importlib.util.find_spec("mooncake") is None or importlib.util.find_spec("mooncake.store") is None:
        yield Finding(
            "dependency",
            f"{field}.kind",
            Verdict.REFUSED,
            f"the Mooncake client: {INSTALL}",
            "mooncake_store",
        )
    else:
        yield Finding("dependency", f"{field}.kind", Verdict.OK, f"client {_version()}")
    host, port = master_address(settings.master)
    why = probe_tcp(host, port, context.timeout_s)
    if why is None:
        yield Finding("server", f"{field}.master", Verdict.OK, f"a master listens at {settings.master}")
    else:
        expected = f"a Mooncake master listening there ({why}): start mooncake_master, or name its host:port"
        yield Finding("server", f"{field}.master", Verdict.REFUSED, expected, settings.master)
    if settings.metadata != "P2PHANDSHAKE":
        url = urlsplit(settings.metadata)
        if url.hostname is None:
            return
        why = probe_tcp(url.hostname, url.port or 80, context.timeout_s)
        verdict, text = (
            (Verdict.OK, f"a metadata server listens at {settings.metadata}")
            if why is None
            else (
                Verdict.WARNING,
                f"no metadata server at {settings.metadata} ({why}): transfers fail until it is up",
            )
        )
        yield Finding("server", f"{field}.metadata", verdict, text)


def _version() -> str:
    try:
        return f"mooncake-transfer-engine {importlib.metadata.version('mooncake-transfer-engine-non-cuda')}"
    except importlib.metadata.PackageNotFoundError:
        return "mooncake (a build whose version is not recorded)"
