"""Provides the ModelConfig of the newer families, read through transformers' own config classes,
and their RoPE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .decoder_config import CompileError, ModelConfig
from .families import Family

# RoPE types taken from transformers' own tables (dynamic NTK depends on each call's length: not
# traced)
TRANSFORMERS_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def decoder_config(family: Family, data: dict[str, Any]) -> Any:
    """transformers' config object of the text decoder in DATA, with every default the model
    class applies."""
    from transformers import CONFIG_MAPPING

    values = {key: value for key, value in data.items() if key != "model_type"}
    if data.get("model_type") == "gemma3" and isinstance(data.get("text_config"), dict):
        # a multimodal checkpoint: only its text decoder is compiled
        values = dict(data["text_config"])
        values.pop("model_type", None)
    return CONFIG_MAPPING[family.model_type](**values)


def _rope_parameters(decoder: Any, layer_type: str | None) -> dict[str, Any]:
    parameters = decoder.rope_parameters or {}
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
        return dict(parameters[layer_type])
    return dict(parameters)


def family_config(family: Family, data: dict[str, Any], origin: str) -> ModelConfig:
    try:
        decoder = decoder_config(family, data)
    except (TypeError, ValueError, KeyError) as error:
        raise CompileError(
            f"{origin}: config does not parse as {family.model_type} ({error})"
        ) from None
    layers = int(decoder.num_hidden_layers)
    layer_types = tuple(getattr(decoder, "layer_types", None) or ())
    window = getattr(decoder, "sliding_window", None)
    if not layer_types and window is not None and family.model_type == "phi3":
        layer_types = ("sliding_attention",) * layers  # Phi-3 applies its window to every layer
    if "sliding_attention" not in layer_types:
        layer_types, window = (), None
    if getattr(decoder, "attn_logit_softcapping", None):
        raise CompileError(f"{origin}: attention logit soft-capping is not supported")
    kinds = sorted(set(layer_types)) or [None]
    for kind in kinds:
        rope_type = _rope_parameters(decoder, kind).get("rope_type", "default")
        if rope_type not in TRANSFORMERS_ROPE_TYPES:
            supported = ", ".join(TRANSFORMERS_ROPE_TYPES)
            raise CompileError(
                f"{origin}: unsupported rope_scaling type {rope_type!r} (supported: {supported})"
            )
    full = _rope_parameters(decoder, "full_attention" if layer_types else None)
    heads = int(decoder.num_attention_heads)
    hidden = int(decoder.hidden_size)
    head_dim = int(getattr(decoder, "head_dim", None) or hidden // heads)
    scalar = getattr(decoder, "query_pre_attn_scalar", None)
    experts = int(
        getattr(decoder, "num_experts", None) or getattr(decoder, "num_local_experts", 0) or 0
    )
    experts = experts if family.experts else 0
    expert_layers: tuple[int, ...] = ()
    if experts:
        step = int(getattr(decoder, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(decoder, "mlp_only_layers", None) or ())
        expert_layers = tuple(
            layer for layer in range(layers) if layer not in dense and (layer + 1) % step == 0
        )
    eos = decoder.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    scaling = {key: value for key, value in full.items() if key != "rope_theta"}
    return ModelConfig(
        model_type=family.model_type,
        architecture=family.architectures[0],
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(decoder.intermediate_size),
        vocab_size=int(decoder.vocab_size),
        num_attention_heads=heads,
        num_kv_heads=int(getattr(decoder, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        rms_norm_eps=float(decoder.rms_norm_eps),
        rope_theta=float(full.get("rope_theta", 10000.0)),
        rope_scaling=None
        if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1
        else scaling,
        max_position_embeddings=int(decoder.max_position_embeddings),
        tie_word_embeddings=bool(getattr(decoder, "tie_word_embeddings", False)),
        bos_token_id=decoder.bos_token_id,
        eos_token_ids=eos_ids,
        pad_token_id=decoder.pad_token_id,
        family=family,
        layer_types=layer_types,
        sliding_window=int(window) if window is not None else None,
        query_scale=float(scalar) ** -0.5 if scalar else None,
        final_logit_softcapping=getattr(decoder, "final_logit_softcapping", None),
        num_experts=experts,
        experts_per_token=int(getattr(decoder, "num_experts_per_tok", 0) or 0) if experts else 0,
        moe_intermediate_size=int(
            getattr(decoder, "moe_intermediate_size", None) or decoder.intermediate_size
        )
        if experts
        else 0,
        norm_topk_prob=bool(getattr(decoder, "norm_topk_prob", False)),
        expert_layers=expert_layers,
        decoder=decoder,
    )


@dataclass(frozen=True)
class RopeTable:
    """Inverse frequencies [rotary_dim / 2] and the cos/sin factor; `long` replaces `short` in a
    call whose highest position reaches `threshold` (LongRoPE, as transformers switches per forward
    call)."""

    short: Any
    scaling: float
    long: Any = None
    threshold: int = 0


def rope_table(config: ModelConfig, layer_type: str | None) -> RopeTable:
    """transformers' own RoPE tables for LAYER_TYPE (None: the model's one table), computed as it
    does."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    decoder = config.decoder
    parameters = _rope_parameters(decoder, layer_type)
    rope_type = parameters.get("rope_type", "default")
    extra = (
        {"layer_type": layer_type}
        if layer_type is not None
        and isinstance((decoder.rope_parameters or {}).get(layer_type), dict)
        else {}
    )
    if rope_type == "default":
        partial = float(parameters.get("partial_rotary_factor", 1.0))
        dim = int(config.head_dim * partial)
        base = parameters["rope_theta"]
        inverse = 1.0 / (
            base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
        )
        return RopeTable(inverse, 1.0)
    initialise = ROPE_INIT_FUNCTIONS[rope_type]
    inverse, scaling = initialise(decoder, None, **extra)
    if rope_type != "longrope":
        return RopeTable(inverse.float(), float(scaling))
    original = int(parameters["original_max_position_embeddings"])
    long, _ = initialise(decoder, None, seq_len=original + 1, **extra)
    return RopeTable(inverse.float(), float(scaling), long.float(), original)
