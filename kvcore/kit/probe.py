"""``probe_tcp``: whether a server listens at an address, asked within a bound and changing nothing there
(a connection opened and closed at once) — what a backend's pre-flight asks of its server."""

from __future__ import annotations

import socket

__all__ = ["probe_tcp"]


def probe_tcp(host: str, port: int, timeout_s: float) -> str | None:
    """``None`` when something accepts a TCP connection at ``host:port`` within ``timeout_s``, else why
    not, as a person reads it (``"connection refused"``, ``"no answer within 2.0 s"``, a name that does
    not resolve)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except socket.gaierror as exc:
        return f"{host!r} does not resolve ({exc.strerror})"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
