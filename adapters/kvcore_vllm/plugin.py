"""The ``vllm.general_plugins`` entry point: registers kvcore's connectors once per vLLM process, checks
kvcore's config in the first process before any model loads, and logs kvcore's records as vLLM's.

vLLM resolves the connector class in its main, engine-core and worker processes and calls every general
plugin in each of them, so everything here is idempotent: the factory raises on a second registration
of the same name, and the method wrapped for the pre-flight is wrapped once.

**Fail in a second.** vLLM calls its plugins in the first process (the API server, or the process that
makes an ``LLM``) before it reads the command line; the engine's config is built later in that process by
``EngineArgs.create_engine_config``, before the engine core is spawned and long before the weights load.
That method is wrapped so that ``kvcore_vllm.preflight.check_before_start`` runs on what it returns,
with the model's shape and vLLM's own memory known; and since building it takes seconds (the model's
config, the platform), the ``--kv-transfer-config`` of the first process's command line is checked at
once, here (``check_command_line``: the config and each tier). A config the engine would refuse stops
vLLM within its start-up's first seconds, with one line naming the field, the value and what was
expected (``sys.excepthook`` prints a pre-flight's refusal without a traceback; any other error is
printed as before).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from kvcore_vllm import CONNECTORS

__all__ = ["LOGGERS", "register"]

LOGGERS = ("kvcore", "kvcore_vllm", "kvcore_cpu", "kvcore_disk", "kvcore_mooncake", "kvcore_lmcache")
"""The loggers of kvcore's packages, whose records go through vLLM's handlers inside vLLM."""
_WRAPPED = "_kvcore_preflight"


def register() -> None:
    """Make ``kv_connector`` "KVCoreConnector" and "KVCorePDConnector" resolvable without a module path,
    check kvcore's config before the engine starts, and log as vLLM logs."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)
    _check_before_start()
    _log_through_vllm()
    if multiprocessing.parent_process() is None:  # the first process: vLLM has not read its arguments yet
        from kvcore_vllm.preflight import check_command_line

        check_command_line(sys.argv)


def _check_before_start() -> None:
    """Wrap ``EngineArgs.create_engine_config`` (once): the config it builds is checked before it is
    returned, so before the engine core starts."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def create_engine_config(self: EngineArgs, *args: Any, **kwargs: Any) -> Any:
        from kvcore_vllm.preflight import check_before_start

        config = original(self, *args, **kwargs)
        check_before_start(config)
        return config

    setattr(create_engine_config, _WRAPPED, True)
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]  # the hook itself
    if not getattr(sys.excepthook, _WRAPPED, False):
        sys.excepthook = _brief(sys.excepthook)


ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def _brief(previous: ExceptHook) -> ExceptHook:
    """An ``excepthook`` that prints a pre-flight's refusal (``RefusedAtStart``) as one line and its
    notes, and hands every other exception to ``previous``."""

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        from kvcore_vllm.preflight import RefusedAtStart

        if not isinstance(error, RefusedAtStart):
            previous(kind, error, trace)
            return
        print(f"kvcore: vLLM not started: {error}", file=sys.stderr)
        for note in getattr(error, "__notes__", ()):
            print(f"  {note}", file=sys.stderr)
        print("  (kvcore doctor checks a config without starting vLLM)", file=sys.stderr)

    setattr(hook, _WRAPPED, True)
    return hook


class _ThroughVLLM(logging.Handler):
    """Hands kvcore's records to vLLM's own handlers, so that they read like vLLM's around them (process,
    pid, level, time, file); before vLLM configured its logging (or where it does not:
    ``VLLM_CONFIGURE_LOGGING=0``) they go where they would go without it: the root logger's handlers,
    or Python's last resort."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if target.handlers:
            if record.levelno >= target.getEffectiveLevel():
                target.handle(record)
            return
        root = logging.getLogger()
        if (
            not root.handlers
            and logging.lastResort is not None
            and record.levelno >= logging.lastResort.level
        ):
            logging.lastResort.handle(record)


def _log_through_vllm() -> None:
    """Route the records of ``LOGGERS`` through ``_ThroughVLLM`` (once), at INFO unless set otherwise."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if any(isinstance(h, _ThroughVLLM) for h in logger.handlers):
            continue
        logger.addHandler(_ThroughVLLM())
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
