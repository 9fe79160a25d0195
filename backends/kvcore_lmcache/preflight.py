"""The LMCache server's pre-flight (``kvcore.plugins.preflight``): the client libraries, and the server
asked within the pre-flight's bound. A server that does not answer is a warning, as it is to the engine,
which starts and serves misses until it does."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from kvcore.kit.probe import probe_tcp
from kvcore.plugins.preflight import Finding, PreflightContext, Verdict
from kvcore_lmcache.config import LMCacheMPConfig

__all__ = ["lmcache_findings"]

MODULES = {"lmcache": "lmcache", "zmq": "pyzmq"}
"""The modules the client needs, and the distribution that installs each."""


def lmcache_findings(settings: LMCacheMPConfig, context: PreflightContext) -> Iterator[Finding]:
    """Every finding about an LMCache server's settings under ``context.field``."""
    field = context.field
    missing = [dist for module, dist in MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        expected = f"the LMCache client's libraries: pip install {' '.join(missing)}"
        yield Finding("dependency", f"{field}.kind", Verdict.REFUSED, expected, "lmcache_mp")
    else:
        yield Finding(
            "dependency", f"{field}.kind", Verdict.OK, f"lmcache {importlib.metadata.version('lmcache')}"
        )
    why = _unreachable(settings.url, context.timeout_s)
    if why is None:
        yield Finding("server", f"{field}.url", Verdict.OK, f"a server listens at {settings.url}")
    else:
        text = (
            f"no LMCache server at {settings.url} ({why}): the engine starts, and every lookup misses until "
            "one answers"
        )
        yield Finding("server", f"{field}.url", Verdict.WARNING, text)


def _unreachable(url: str, timeout_s: float) -> str | None:
    """Why nothing answers at a ZeroMQ endpoint (``tcp://host:port`` asked, ``ipc://path`` looked for),
    ``None`` when something does (or for a transport that cannot be asked without joining it)."""
    parts = urlsplit(url)
    if parts.scheme == "tcp" and parts.hostname is not None and parts.port is not None:
        return probe_tcp(parts.hostname, parts.port, timeout_s)
    if parts.scheme == "ipc":
        path = Path(url.removeprefix("ipc://"))
        return None if path.exists() else f"{path} does not exist"
    return None
