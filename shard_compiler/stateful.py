"""Provides the KV-cache graph transforms: beam_idx Gather injection, make-stateful, zero-length
initializers."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from remote_worker.manifest import LayerRange

logger = logging.getLogger(__name__)


def state_name(layer: int, kind: str) -> str:
    """The variable id apply_make_stateful_transformation gives the cache of LAYER (kind
    "key"/"value")."""
    return f"past_key_values.{layer}.{kind}present.{layer}.{kind}"


def cache_pairs(layers: LayerRange) -> list[tuple[str, str]]:
    return [
        (f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}")
        for layer in range(layers.start, layers.end)
        for kind in ("key", "value")
    ]


def inject_beam_idx(model: Any, layers: LayerRange) -> None:
    """Add a `beam_idx` [1] i32 Parameter and a Gather(cache, beam_idx, axis 0) after every cache
    input.

    Run before make_stateful so the Gather ends up right after each ReadValue, the pattern the CPU
    plugin's fused KV-cache/SDPA path looks for (optimum-intel's fuse_cache_reorder).
    """
    import openvino as ov
    from openvino import opset13

    beam_idx = opset13.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    model.add_parameters([beam_idx])
    for input_name, _ in cache_pairs(layers):
        port = model.input(input_name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, opset13.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    model.validate_nodes_and_infer_types()


def make_stateful(model: Any, layers: LayerRange, kv_heads: int, head_dim: int) -> tuple[str, ...]:
    """Turn the cache inputs/outputs into ReadValue/Assign pairs with [batch, kv, 0, d] zero
    initializers.

    Returns the variable ids in layer order (key, value per layer).
    """
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    apply_make_stateful_transformation(model, dict(cache_pairs(layers)))
    main = model.inputs[0]
    batch = opset13.gather(
        opset13.shape_of(main, output_type="i64"), opset13.constant([0]), opset13.constant(0)
    )
    rest = opset13.constant(np.array([kv_heads, 0, head_dim], dtype=np.int64))
    shape = opset13.concat([batch, rest], axis=0)
    found: dict[str, Any] = {}
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            initial = opset13.broadcast(opset13.constant(np.float32(0.0)), shape)
            op.set_arguments([initial])
            found[op.get_variable_id()] = op
    model.validate_nodes_and_infer_types()
    names = tuple(
        state_name(layer, kind)
        for layer in range(layers.start, layers.end)
        for kind in ("key", "value")
    )
    missing = [name for name in names if name not in found]
    if missing or len(found) != len(names):
        raise RuntimeError(
            f"make_stateful: variables {sorted(found)} do not match the expected {list(names)}"
        )
    return names
