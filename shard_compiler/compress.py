"""Provides weight compression with NNCF: int4 symmetric (embedding and lm_head kept int8) or
int8."""

from __future__ import annotations

import logging
from typing import Any

from .sources import CompileError, ModelConfig

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int8", "int4")


def group_size(config: ModelConfig, precision: str) -> int | None:
    """The int4 group size: 128 when every input-channel size divides by it, else 64 (SmolLM2's
    576)."""
    if precision != "int4":
        return None
    channels: tuple[int, ...] = (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads * config.head_dim,
    )
    if config.num_experts:  # the experts' own width (Qwen3-MoE: 768 beside a dense 6144)
        channels += (config.moe_intermediate_size,)
    for size in (128, 64, 32):
        if all(channel % size == 0 for channel in channels):
            return size
    raise CompileError(f"int4: no group size in 128/64/32 divides the channel sizes {channels}")


def _vocabulary_nodes(model: Any, config: ModelConfig) -> list[str]:
    """Names of the embedding Gather and lm_head MatMul (the ops reading a [vocab, hidden]
    weight)."""
    names = []
    for op in model.get_ops():
        if op.get_type_name() not in ("Gather", "MatMul"):
            continue
        for value in op.input_values():
            shape = value.get_partial_shape()
            if shape.is_static and list(shape.to_shape()) == [
                config.vocab_size,
                config.hidden_size,
            ]:
                names.append(op.get_friendly_name())
                break
    return names


def compress(model: Any, config: ModelConfig, precision: str, group: int | None) -> Any:
    """Return MODEL with NNCF-compressed weights for int8/int4; fp32/fp16 models are returned
    unchanged."""
    if precision in ("fp32", "fp16"):
        return model
    import nncf

    if precision == "int8":
        return _share_duplicates(
            nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        )
    vocabulary = _vocabulary_nodes(model, config)
    ignored = nncf.IgnoredScope(names=vocabulary, validate=False) if vocabulary else None
    model = nncf.compress_weights(
        model,
        mode=nncf.CompressWeightsMode.INT4_SYM,
        group_size=group,
        ratio=1.0,
        all_layers=True,
        ignored_scope=ignored,
    )
    if vocabulary:
        # Only the embedding / lm_head weights are still float: this pass makes them int8.
        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    return _share_duplicates(model)


def _share_duplicates(model: Any, minimum_bytes: int = 1 << 16) -> Any:
    """Merge identical large constants: NNCF compresses a tied embedding / lm_head weight twice."""
    import hashlib

    seen: dict[tuple[str, tuple[int, ...], str], Any] = {}
    merged = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Constant" or op.get_byte_size() < minimum_bytes:
            continue
        data = op.get_data()
        key = (
            op.get_element_type().get_type_name(),
            tuple(op.get_output_shape(0)),
            hashlib.sha256(data.tobytes()).hexdigest(),
        )
        if key in seen:
            for target in op.output(0).get_target_inputs():
                target.replace_source_output(seen[key].output(0))
            merged += 1
        else:
            seen[key] = op
    if merged:
        logger.info("shared %d duplicated weight constants", merged)
        model.validate_nodes_and_infer_types()
    return model
