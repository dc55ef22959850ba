"""Provides the conformance registry: one tiny seeded model per supported architecture, and its
listing.

The harness (tests/integration/test_conformance.py) builds each entry with transformers' own config
and model classes, writes it as a Hugging Face folder and as a GGUF, compiles it to 1, 2 and 3
stages and checks it against transformers. An architecture is supported when its entry passes;
`python -m shard_compiler.conformance` prints the list the README carries."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .families import family_of

VOCAB = 320  # the tiny byte-level tokenizer's 259 tokens, padded with unused ones
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
}


@dataclass(frozen=True)
class Entry:
    """A tiny model of one architecture: its transformers config values and the splits the
    harness compiles."""

    model_type: str
    label: str  # what the README lists
    config: dict[str, Any]
    splits: tuple[tuple[int, ...], ...] = ((0, 3), (0, 1, 3), (0, 1, 2, 3))
    formats: tuple[str, ...] = ("hf", "gguf")
    notes: str = ""
    # also run through real stage processes (speculation, sessions, rollbacks)
    pipeline: bool = False
    # the embedding's random scale (Gemma's sqrt(hidden) needs a smaller one)
    embed_std: float = 0.5
    # the harness's id when one model_type has several entries (default: the model_type)
    name: str = ""

    @property
    def key(self) -> str:
        return self.name or self.model_type


REGISTRY: tuple[Entry, ...] = (
    Entry("llama", "Llama (2, 3.x)", {**_COMMON, "num_hidden_layers": 3, "rope_theta": 10000.0}),
    Entry(
        "llama",
        "Llama 3.x rope_scaling (llama3)",
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        formats=("hf",),
        name="llama-rope3",
        notes="GGUF keeps llama3 factors in a tensor transformers' reader ignores",
    ),
    Entry(
        "mistral",
        "Mistral",
        {**_COMMON, "num_hidden_layers": 3, "sliding_window": None},
        formats=("hf",),
        notes="GGUF: llama.cpp writes Mistral as llama",
    ),
    Entry("qwen2", "Qwen2 / Qwen2.5 (qkv bias)", {**_COMMON, "num_hidden_layers": 3}),
    Entry("qwen3", "Qwen3 (per-head QK-norm)", {**_COMMON, "num_hidden_layers": 3}),
    Entry(
        "phi3",
        "Phi-3 / Phi-4-mini (fused qkv and gate_up, partial rotary, LongRoPE short factors)",
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 64,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(6)],
                "long_factor": [1.0 + 0.5 * i for i in range(6)],
            },
        },
    ),
    Entry(
        "phi3",
        "Phi-3 128k: LongRoPE long factors once a call passes the original context",
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 8,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(6)],
                "long_factor": [1.0 + 0.5 * i for i in range(6)],
            },
        },
        splits=((0, 1, 3),),
        name="phi3-long",
    ),
    Entry(
        "gemma3_text",
        "Gemma 3 text decoder (sliding/global layers, QK-norm, sandwich norms, GeGLU)",
        {
            **_COMMON,
            "num_hidden_layers": 6,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 4,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        splits=((0, 6), (0, 4, 6), (0, 2, 4, 6)),
        pipeline=True,
        embed_std=0.03,
    ),
    Entry(
        "gemma3_text",
        "Gemma 3 with logit soft-capping, linear RoPE scaling and global layers 2 and 5",
        {
            **_COMMON,
            "num_hidden_layers": 6,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 3,
            "sliding_window_pattern": 3,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        splits=((0, 6), (0, 3, 6), (0, 2, 4, 6)),
        formats=("hf",),
        name="gemma3_text-softcap",
        embed_std=0.03,
        notes="GGUF carries neither soft-capping nor the layer pattern",
    ),
    Entry(
        "qwen3_moe",
        "Qwen3-MoE (router softmax, top-k experts, norm_topk_prob)",
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        pipeline=True,
    ),
    Entry(
        "qwen3_moe",
        "Qwen3-MoE with dense layers (mlp_only_layers)",
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        },
        formats=("hf",),
        name="qwen3_moe-dense",
        notes="GGUF: llama.cpp's qwen3moe has no dense layers",
    ),
    Entry(
        "gpt_oss",
        "gpt-oss (attention sinks, sliding/full layers, YaRN, clamped SwiGLU experts with biases)",
        {
            **_COMMON,
            "num_hidden_layers": 3,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "rope_theta": 150000.0,
            "max_position_embeddings": 2048,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        },
        formats=("hf",),
        notes="GGUF: its MXFP4 experts are not read",
    ),
)


def entries() -> dict[str, Entry]:
    return {entry.key: entry for entry in REGISTRY}


def covered_architectures() -> list[str]:
    """The model_types the conformance harness covers (a README's supported list)."""
    return list(dict.fromkeys(entry.model_type for entry in REGISTRY))


def markdown() -> str:
    lines = ["| model_type | architecture | formats checked | stages |", "|---|---|---|---|"]
    for entry in REGISTRY:
        stages = ", ".join(str(len(split) - 1) for split in entry.splits)
        formats = " + ".join({"hf": "safetensors", "gguf": "GGUF"}[kind] for kind in entry.formats)
        lines.append(f"| `{entry.model_type}` | {entry.label} | {formats} | {stages} |")
    lines.append("")
    lines.append(
        "GGUF metadata and tensor names follow llama.cpp (`general.architecture`: "
        + ", ".join(
            sorted(
                {family_of(entry.model_type).gguf for entry in REGISTRY if "gguf" in entry.formats}  # type: ignore[union-attr]
            )
        )
        + ")."
    )
    return "\n".join(lines)


def tiny_model(entry: Entry, seed: int = 0) -> Any:
    """transformers' own model of ENTRY in f32 with seeded random weights (norm weights random
    too)."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    values = dict(entry.config)
    config = CONFIG_MAPPING[entry.model_type](**values)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            scale = 0.2 if "norm" in name else (entry.embed_std if "embed" in name else 0.08)
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return model


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
