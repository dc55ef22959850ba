"""Provides synthetic models: a real architecture's config with seeded random weights (no
tokenizer).

`synthetic:llama-3.2-1b` is Llama-3.2-1B's exact shape (layers, widths, heads, vocabulary, llama3
RoPE) with weights drawn from a seeded generator, so a model too big for one PC can be compiled,
sharded and timed exactly like a real one without downloading it. `synthetic:NAME@N` keeps only the
first N layers (CI compiles a small one quickly). The output is meaningless text: the manifest says
`synthetic: true`, and chat refuses it; greedy token ids are still deterministic, so exactness tests
work on it."""

from __future__ import annotations

import hashlib
import re
from typing import Any

PREFIX = "synthetic:"
GENERATOR_VERSION = "1"  # part of the source hash: a change of the weight recipe recompiles
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    # A Llama-shaped toy for tests: every code path of the real ones, compiled in seconds.
    "llama-tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


class SyntheticError(ValueError):
    """A synthetic model name that does not parse or names no known architecture."""


def is_synthetic(model: str) -> bool:
    return model.startswith(PREFIX)


def parse(model: str) -> tuple[str, int | None]:
    """`synthetic:NAME[@LAYERS]` -> (NAME, LAYERS or None); SyntheticError names the problem."""
    match = re.fullmatch(re.escape(PREFIX) + r"([\w.-]+?)(?:@(\d+))?", model)
    if not match:
        raise SyntheticError(f"model {model!r}: expected synthetic:NAME or synthetic:NAME@LAYERS")
    name, layers = match.group(1), match.group(2)
    if name not in ARCHITECTURES:
        raise SyntheticError(
            f"model {model!r}: no synthetic architecture {name!r} (known: "
            f"{', '.join(ARCHITECTURES)})"
        )
    count = int(layers) if layers is not None else None
    full = ARCHITECTURES[name]["num_hidden_layers"]
    if count is not None and not 1 <= count <= full:
        raise SyntheticError(f"model {model!r}: layer count {count} outside 1..{full}")
    return name, count


def config(model: str) -> dict[str, Any]:
    """The Hugging Face style config dict of a synthetic model name (with the layer override
    applied)."""
    name, layers = parse(model)
    data = dict(ARCHITECTURES[name])
    if layers is not None:
        data["num_hidden_layers"] = layers
    data["_name_or_path"] = model
    return data


def display_name(model: str) -> str:
    """The model name in manifests and tables: synthetic-llama-3.2-1b (or ...-l4 with a layer
    override)."""
    name, layers = parse(model)
    return f"synthetic-{name}" + (f"-l{layers}" if layers is not None else "")


class SyntheticWeights:
    """Tensors by Hugging Face name, drawn from a generator seeded by (seed, name): same name, same
    tensor.

    Linear weights ~ N(0, 0.02) like a fresh Llama init (lm_head wider, so logits have clear
    winners); norms are ones. Only what the compiler asks for is ever generated."""

    def __init__(self, data: dict[str, Any], seed: int = 0) -> None:
        self.data = data
        self.seed = seed
        self.shapes = _shapes(data)

    def __contains__(self, key: str) -> bool:
        return key in self.shapes

    def get(self, key: str) -> Any:
        import torch

        if key not in self.shapes:
            raise SyntheticError(f"synthetic weights: tensor {key!r} not in the architecture")
        shape = self.shapes[key]
        if key.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.float32)
        digest = hashlib.sha256(f"{self.seed}:{key}".encode()).digest()
        generator = torch.Generator().manual_seed(
            int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
        )
        scale = (
            0.08
            if key == "lm_head.weight" or (key.startswith("model.embed") and self.tied)
            else 0.02
        )
        return torch.randn(shape, generator=generator, dtype=torch.float32) * scale

    @property
    def tied(self) -> bool:
        return bool(self.data.get("tie_word_embeddings"))


def _shapes(data: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inner = data["hidden_size"], data["intermediate_size"]
    heads, kv_heads = data["num_attention_heads"], data["num_key_value_heads"]
    head_dim = data.get("head_dim") or hidden // heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (data["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not data.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (data["vocab_size"], hidden)
    for layer in range(data["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes.update(
            {
                f"{prefix}.input_layernorm.weight": (hidden,),
                f"{prefix}.post_attention_layernorm.weight": (hidden,),
                f"{prefix}.self_attn.q_proj.weight": (heads * head_dim, hidden),
                f"{prefix}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                f"{prefix}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                f"{prefix}.mlp.gate_proj.weight": (inner, hidden),
                f"{prefix}.mlp.up_proj.weight": (inner, hidden),
                f"{prefix}.mlp.down_proj.weight": (hidden, inner),
            }
        )
    return shapes
