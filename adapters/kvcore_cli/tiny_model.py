"""Build a tiny random-weight Llama model, a DeepSeek-V2-style MLA one, a Gemma-3-style hybrid one
(sliding-window and full attention layers; Gemma-4-style: their blocks of two sizes) or a Qwen3-Next-style
hybrid SSM one (Gated DeltaNet and full attention layers), and their BPE tokenizer, on local disk.

The models are for trying kvcore and for its tests: each loads in vLLM's CPU build in seconds and needs
no download. Weights are random (bf16, normal(0, 0.2)), so generations are gibberish but deterministic
under greedy sampling: a reuse that changes a token is a wrong KV. ``kvcore tiny-model OUT_DIR [--kind
llama]`` writes one (the quick starts of docs/vllm.md and docs/disk.md); transformers and tokenizers,
which vLLM brings, are imported only then.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import torch
from attrs import frozen
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

CORPUS: Final[tuple[str, ...]] = (
    "The quick brown fox jumps over the lazy dog.",
    "A key value cache stores attention keys and values for every token.",
    "Prefix caching lets a server reuse the work done for a shared prompt.",
    "Offloading moves blocks of the cache from fast memory to slower memory.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Hello world! How are you today? I am fine, thank you.",
    "def main() -> None: print('hello')",
)
SPECIAL_TOKENS: Final[tuple[str, ...]] = ("<unk>", "<s>", "</s>", "<pad>")
VOCAB_TARGET: Final[int] = 512

WEIGHT_STD: Final[float] = 0.2

ModelT = TypeVar("ModelT", bound=PreTrainedModel)


@frozen
class ModelShape:
    """A Llama's size. ``head_dim`` must be one vLLM's CPU attention supports (32, 64, 80, 96, ...)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_positions: int = 4096


TINY = ModelShape()
BENCH = ModelShape(  # BENCHMARKS.md's TTFT model: 8 KiB of bf16 KV per token
    hidden_size=1024,
    intermediate_size=2048,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    max_positions=8192,
)
SERVE = ModelShape(  # bench_serve's model: in float32, prefill dominates a step as with real models on a CPU
    hidden_size=768,
    intermediate_size=2048,
    num_layers=6,
    num_heads=12,
    num_kv_heads=4,
    head_dim=64,
    max_positions=8192,
)


def build_tokenizer(corpus: tuple[str, ...] = CORPUS) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` and wrap it for transformers."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, shape: ModelShape = TINY
) -> LlamaForCausalLM:
    """Create a Llama of ``shape`` with random bf16 weights sized to ``tokenizer``."""
    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        **_shared_fields(tokenizer),
    )
    torch.manual_seed(seed)
    model: LlamaForCausalLM = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    return _randomized(model, WEIGHT_STD)


def _shared_fields(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """Config fields of every tiny model: the tokenizer's vocabulary and special ids, bf16, untied."""
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _randomized(model: ModelT, std: float) -> ModelT:
    """``model`` in bf16 with every weight drawn from normal(0, ``std``) (torch's seed set before)."""
    model = model.bfloat16()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    return model


def _write(out_dir: str | Path, tokenizer: PreTrainedTokenizerFast, model: PreTrainedModel) -> Path:
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path


def make_tiny_model(out_dir: str | Path, seed: int = 0, shape: ModelShape = TINY) -> Path:
    """Write tokenizer and model to ``out_dir`` (created if needed); return the path."""
    tokenizer = build_tokenizer()
    return _write(out_dir, tokenizer, build_model(tokenizer, seed=seed, shape=shape))


MLA_WEIGHT_STD: Final[float] = 0.05
"""Smaller than the Llama's: the MLA projections are wide (512), and 0.2 saturates the logits into one
token repeated, which would hide a wrong KV."""


def make_tiny_mla_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A two-layer DeepSeek-V2-style model with MLA (one latent of 512 + 64 per token) and random bf16
    weights, written to ``out_dir``. The latent sizes are the only ones vLLM's CPU MLA kernels take (head
    576, value head 512); the rest is tiny, and dense (vLLM's CPU MoE router wants grouped top-k)."""
    tokenizer = build_tokenizer()
    config = DeepseekV2Config(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=2,
        num_experts_per_tok=1,
        first_k_dense_replace=2,  # every layer dense: the MoE fields only satisfy the config's checks
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=512,
        max_position_embeddings=4096,
        **_shared_fields(tokenizer),
    )
    torch.manual_seed(seed)
    model: DeepseekV2ForCausalLM = DeepseekV2ForCausalLM(config)  # type: ignore[no-untyped-call]
    return _write(out_dir, tokenizer, _randomized(model, MLA_WEIGHT_STD))


HYBRID_WINDOW: Final[int] = 200
"""The sliding window of ``make_tiny_hybrid_model``'s sliding-window layers, in tokens."""


def make_tiny_hybrid_model(out_dir: str | Path, seed: int = 0, *, sliding_only: bool = False) -> Path:
    """A four-layer Gemma-3-style model (sliding-window and full attention layers alternating, a window of
    ``HYBRID_WINDOW`` tokens) with random bf16 weights, written to ``out_dir``: vLLM's hybrid KV-cache
    manager keeps it as two KV-cache groups. Head size 64, one vLLM's CPU attention takes.
    ``sliding_only``: every layer uses the window (a Mistral-style model: one sliding-window group)."""
    tokenizer = build_tokenizer()
    config = Gemma3TextConfig(
        query_pre_attn_scalar=64,
        **_gemma_fields(tokenizer, ["sliding_attention"] * 4 if sliding_only else None),
    )
    torch.manual_seed(seed)
    model: Gemma3ForCausalLM = Gemma3ForCausalLM(config)
    return _write(out_dir, tokenizer, _randomized(model, WEIGHT_STD))


def _gemma_fields(tokenizer: PreTrainedTokenizerFast, layer_types: list[str] | None = None) -> dict[str, Any]:
    """Config fields of the tiny Gemma-style models: four layers, sliding-window and full attention
    alternating unless ``layer_types`` says otherwise, a window of ``HYBRID_WINDOW`` tokens, heads of 64."""
    return {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sliding_window": HYBRID_WINDOW,
        "layer_types": layer_types or ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 4096,
        **_shared_fields(tokenizer),
    }


def make_tiny_two_block_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A four-layer Gemma-4-style model, written to ``out_dir``: sliding-window and full attention layers
    alternating (a window of ``HYBRID_WINDOW`` tokens), the full attention layers with heads of 128, the
    sliding-window ones of 64. vLLM keeps two KV-cache groups of one page size, so of two block sizes: 256
    tokens for the sliding-window group, 128 for the full attention one."""
    tokenizer = build_tokenizer()
    config = Gemma4TextConfig(  # type: ignore[call-arg]  # global_head_dim is read from its kwargs
        global_head_dim=128,
        hidden_size_per_layer_input=0,  # no per-layer input embeddings
        vocab_size_per_layer_input=len(tokenizer),
        **_gemma_fields(tokenizer),
    )
    torch.manual_seed(seed)
    model: Gemma4ForCausalLM = Gemma4ForCausalLM(config)
    return _write(out_dir, tokenizer, _randomized(model, WEIGHT_STD))


SSM_WEIGHT_STD: Final[float] = 0.05


def make_tiny_ssm_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A four-layer Qwen3-Next-style model (three Gated DeltaNet layers, then one full attention layer;
    a small MoE) with random bf16 weights, written to ``out_dir``: vLLM keeps each GDN layer's state in a
    KV-cache group of Mamba states, and the attention layer in one of full attention. Head sizes are 64,
    which vLLM's CPU kernels take (32 is refused). Every GDN layer decays slowly (``A_log`` -8,
    ``dt_bias`` -4): random weights otherwise forget half the state per token, and a wrong state would
    leave the next tokens unchanged."""
    tokenizer = build_tokenizer()
    config = Qwen3NextConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=4096,
        **_shared_fields(tokenizer),
    )
    torch.manual_seed(seed)
    built: Qwen3NextForCausalLM = Qwen3NextForCausalLM(config)  # type: ignore[no-untyped-call]
    model = _randomized(built, SSM_WEIGHT_STD)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(-8.0)
            elif name.endswith("dt_bias"):
                param.fill_(-4.0)
    return _write(out_dir, tokenizer, model)


MAKERS: Final[dict[str, Callable[[Path, int], Path]]] = {
    "llama": make_tiny_model,
    "mla": make_tiny_mla_model,
    "hybrid": make_tiny_hybrid_model,
    "two-block": make_tiny_two_block_model,
    "ssm": make_tiny_ssm_model,
}
"""The tiny models ``kvcore tiny-model --kind`` makes."""
