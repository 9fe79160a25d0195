"""The LMCache tests' engines stepped by hand (``tests.hand_engine``) on a server, with no host pool (the
blocks move straight between the engines and the server's slots)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from kvcore.config import load_config
from kvcore.model.engine import EngineSpec
from tests.hand_engine import BLOCK, CHUNK_TOKENS, CHUNKS, PER_CHUNK, Engine, engine_spec, prompt, save
from tests.lmcache.conftest import LMCacheServer

__all__ = [
    "BLOCK",
    "CHUNKS",
    "PER_CHUNK",
    "Engine",
    "EngineFactory",
    "engine_factory",
    "engine_spec",
    "prompt",
    "save",
]


EngineFactory = Callable[..., Engine]
"""``engines(spec, seed, server=..., **backend_settings)``: an engine on a server (the shared one by
default), closed at the test's end."""


@contextlib.contextmanager
def engine_factory(default: LMCacheServer) -> Iterator[EngineFactory]:
    """The ``engines`` fixture (``conftest``)."""
    made: list[Engine] = []

    def make(spec: EngineSpec, seed: int, server: LMCacheServer = default, **settings: Any) -> Engine:
        backend: dict[str, Any] = {"kind": "lmcache_mp", "url": server.url, "heartbeat_s": 0.5, **settings}
        config = load_config({"chunk_tokens": CHUNK_TOKENS, "backend": backend})
        engine = Engine(config, spec, seed)
        made.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in made:
            engine.close()
