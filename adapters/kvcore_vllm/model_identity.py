"""Which model a vLLM engine runs, as kvcore's keys name it: from what decides its KV bytes, never from
what the model is called.

Two engines share KV only if the same tokens give the same K and V in both. That depends on the model's
weights, its config (the file's bytes and vLLM's ``hf_overrides``), the dtype it computes in and its
quantization, and on nothing that names them: the same path or hub id may
hold other weights tomorrow (a re-pointed symlink, a branch that moved, a fine-tune written over a
folder), and the same weights may sit at another path on another host. So the model id is a digest of
those facts, the weights read from their files (``weights_fingerprint``), led by the config's
``model_type`` for people who read it (``llama-3f9a...``).

The weights' fingerprint reads every tensor's first and last bytes from safetensors files (and the
files' headers: names, dtypes, shapes, offsets), and a sample every ``_STRIDE`` bytes of any other weight
file: a change of weights that leaves all of those bytes alone (no dense update of any tensor does) is
not seen; bump ``epoch`` for such a change. Weights vLLM reads from elsewhere than a local file (object
stores, tensorizer, a custom loader with no local folder) cannot be read here: the model's name and
revision stand for them then, with a warning (``epoch`` is then the operator's tool). vLLM's dummy
weights are a fixed function of the config (seeded), and are named so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["model_identity", "weights_fingerprint"]

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""The files whose bytes are weights, in a model folder (vLLM's loaders read these)."""

_SAMPLE = 64
"""Bytes read at each end of a safetensors tensor."""
_STRIDE = 1 << 20
"""Bytes between two samples of a weight file kvcore cannot parse."""
_STRIDE_SAMPLE = 4096
_HEADER_LIMIT = 100 << 20
"""The largest safetensors header read (the format's own limit is 100 MB)."""
CONFIG_FILE = "config.json"


def model_identity(vllm_config: VllmConfig) -> str:
    """The model id of an engine (``EngineSpec.model_id``): ``<model_type>-<digest>`` over the config,
    the compute dtype, the quantization and the weights (module docstring). Every process of the engine
    derives the same id: from files and from what vLLM resolved before any process built the model
    (building it may change the config object in that process)."""
    model, load = vllm_config.model_config, vllm_config.load_config
    weights = _local_weights(model, load.download_dir)
    label = str(getattr(model.hf_config, "model_type", "") or "model")
    facts = {
        "config": _config_facts(model, weights),
        "dtype": str(model.dtype),
        "quantization": str(model.quantization),
        "weights": _weights_facts(model, str(load.load_format), weights),
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()
    return f"{label}-{digest[:32]}"


def weights_fingerprint(files: Iterable[Path]) -> str:
    """A digest of weight ``files`` (module docstring): their names within their folder, sizes and
    sampled bytes. Raises ``OSError`` for a file that cannot be read."""
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            digest.update(f"{path.name}\0{size}\0".encode())
            fd = file.fileno()
            if path.suffix == ".safetensors" and _safetensors(fd, size, digest):
                continue
            _strided(fd, size, digest)
    return digest.hexdigest()


def _config_facts(model: Any, weights: Path | None) -> str:
    """The config file's bytes (``hf_config_path``'s, or the weights folder's) and vLLM's overrides of it;
    where there is no such file (a GGUF file, remote weights), the config vLLM read, less the keys that
    say where and with what it was read."""
    overrides = getattr(model, "hf_overrides", None)
    if callable(overrides):
        overrides = f"{overrides.__module__}.{overrides.__qualname__}"
    where = getattr(model, "hf_config_path", None) or weights
    config = None if where is None else Path(str(where)) / CONFIG_FILE
    if config is not None and config.is_file():
        read = hashlib.sha256(config.read_bytes()).hexdigest()
    else:
        to_dict = getattr(model.hf_config, "to_dict", None)
        fields = dict(to_dict()) if callable(to_dict) else dict(vars(model.hf_config))
        read = json.dumps(
            {k: v for k, v in fields.items() if not k.startswith("_") and k != "transformers_version"},
            sort_keys=True,
            default=str,
        )
    return json.dumps([read, overrides], sort_keys=True, default=str)


def _weights_facts(model: Any, load_format: str, weights: Path | None) -> str:
    if load_format == "dummy":
        return "vllm-dummy-weights"  # vLLM draws them from a fixed seed, per the config above
    files = [] if weights is None else _weight_files(weights)
    name = f"{model.model}@{model.revision or 'default'}"
    if not files:
        log.warning(
            "kvcore: the weights of %s are not in a local file kvcore can read (load format %s): keys name "
            "the model by name and revision; bump kvcore's epoch whenever its weights change",
            name,
            load_format,
        )
        return f"named:{name}"
    start = time.perf_counter()
    try:
        fingerprint = weights_fingerprint(files)
    except OSError as exc:
        log.warning("kvcore: cannot read the weights of %s (%s): keys name the model by name", name, exc)
        return f"named:{name}"
    log.info(
        "kvcore: weights of %s fingerprinted (%d files) in %.2f s",
        weights,
        len(files),
        time.perf_counter() - start,
    )
    return f"files:{fingerprint}"


def _local_weights(model: Any, download_dir: str | None) -> Path | None:
    """The folder (or file) vLLM read the weights from: a local path, or the hub's cached snapshot of
    the model at its revision (found without network: the engine downloaded it before kvcore starts)."""
    where = Path(str(getattr(model, "model_weights", "") or model.model))
    if where.exists():
        return where
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                str(model.model), revision=model.revision, cache_dir=download_dir, local_files_only=True
            )
        )
    except Exception:  # not on the hub, not cached, no hub client: the caller falls back to the name
        return None


def _weight_files(where: Path) -> list[Path]:
    if where.is_file():
        return [where]
    return sorted(p for p in where.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def _safetensors(fd: int, size: int, digest: Any) -> bool:
    """Digest a safetensors file's header and its tensors' first and last bytes; False if it is not one
    (the caller samples it as any file)."""
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        return False
    (length,) = struct.unpack("<Q", head)
    if not 2 <= length <= min(_HEADER_LIMIT, size - 8):
        return False
    header = os.pread(fd, length, 8)
    try:
        tensors = json.loads(header)
        spans = sorted(
            (int(entry["data_offsets"][0]), int(entry["data_offsets"][1]))
            for name, entry in tensors.items()
            if name != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False
    digest.update(header)
    base = 8 + length
    for begin, end in spans:
        if end - begin <= 2 * _SAMPLE:
            digest.update(os.pread(fd, max(0, end - begin), base + begin))
        else:
            digest.update(os.pread(fd, _SAMPLE, base + begin))
            digest.update(os.pread(fd, _SAMPLE, base + end - _SAMPLE))
    return True


def _strided(fd: int, size: int, digest: Any) -> None:
    for offset in range(0, size, _STRIDE):
        digest.update(os.pread(fd, _STRIDE_SAMPLE, offset))
    if size > _STRIDE_SAMPLE:
        digest.update(os.pread(fd, _STRIDE_SAMPLE, size - _STRIDE_SAMPLE))
