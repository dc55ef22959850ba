"""Provides ModelConfig (the architecture facts a stage is built from) and CompileError."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .families import FAMILIES, Family


class CompileError(Exception):
    """A compile request that cannot be carried out; the message is one line naming the culprit."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the stage builder and the manifest need."""

    model_type: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # The per-family departures (families.py) and what they read from the config; defaults are plain
    # Llama.
    family: Family = FAMILIES["llama"]
    layer_types: tuple[
        str, ...
    ] = ()  # "full_attention" | "sliding_attention" per layer; () = all full
    # a local layer's query sees keys less than this many positions back
    sliding_window: int | None = None
    query_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    expert_layers: tuple[int, ...] = ()  # layers whose MLP is the sparse mixture of experts
    # transformers' config object (RoPE tables)
    decoder: Any = field(default=None, compare=False, repr=False)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
