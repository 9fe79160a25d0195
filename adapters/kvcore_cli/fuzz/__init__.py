"""``kvcore fuzz``: a seeded lifecycle fuzzer of the engine-agnostic API, checked against a KV oracle.

A model engine drives ``CacheScheduler`` and a ``BlockWorker`` over the CPU tier's real mover (and, with
``remote``, the in-memory reference store and index behind the pool) the way ``docs/engine-api.md`` says an
engine does: multi-turn chats over shared prefixes with per-request salts, chunked prefill and decode, its
own prefix cache, finishes and aborts at every point, preemptions whose blocks go to other requests at
once, resets with copies in flight, lookups by tokens and by the engine's own chained block hashes. Faults
come through every port: mover and remote jobs that fail (wholly or in part) or finish steps late, remote
lookups that fail or answer late.

The engine "computes" KV deterministically, so every block kvcore loads is checked byte for byte, and so
is every block the engine holds, after every step; bytes of another request, another salt, an earlier
epoch, a failed copy or a block never written are told apart, and named in the error.

A seed fixes the run: decisions come from ``random.Random`` streams derived from it, and no copy runs when
a thread gets round to it: the fuzzer's mover and remote tier hold each job until the step its seeded fate
names, then run it to completion through the real parts. ``kvcore fuzz --seed S --steps N`` replays a run.

The modules: ``run`` wires a run together; ``engine`` is the model engine's scheduling and ``connector``
its calls into kvcore; ``requests`` and ``memory`` are the engine's requests and KV memory; ``oracle`` and
``checks`` are the expected bytes and their checks; ``faulty_ports`` and ``postponed`` inject the faults;
``options``, ``results`` and ``trace`` are what a run is asked and what it answers. ``kvcore fuzz --pd`` runs
another fuzz, the vLLM adapter's (``kvcore_vllm.pd_fuzz``, in a process of its own): P/D beside the tiers.
"""

from __future__ import annotations

from kvcore_cli.fuzz.options import FuzzOptions
from kvcore_cli.fuzz.results import FuzzFailure, FuzzSummary
from kvcore_cli.fuzz.run import run_fuzz

__all__ = ["FuzzFailure", "FuzzOptions", "FuzzSummary", "run_fuzz"]
