"""Provides how a stage's shard meets the OpenVINO plugin: compile properties, their report, the
logits slice."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger("remote_worker.engine")

REPORTED_PROPERTIES = (
    "INFERENCE_PRECISION_HINT",
    "KV_CACHE_PRECISION",
    "KEY_CACHE_PRECISION",
    "VALUE_CACHE_PRECISION",
    "INFERENCE_NUM_THREADS",
    "NUM_STREAMS",
    "PERFORMANCE_HINT",
    "EXECUTION_DEVICES",
)
# the input slice_logits adds: how many of the step's last rows get logits
LOGITS_KEEP = "logits_keep"


class EngineError(RuntimeError):
    """A request the engine cannot serve; the message says why in one line."""


def slice_logits(model: Any) -> bool:
    """Give the head only the last LOGITS_KEEP rows of its input: a Slice and an i64 [1] input are
    put before the MatMul that makes the `logits` output. A prefill of n tokens then projects one
    row onto the vocabulary, not n (its other rows were thrown away); the kept rows' values are
    those of the whole projection. False (the model unchanged) when the output is not made that
    way."""
    import openvino as ov
    from openvino import opset8 as ops

    result = model.outputs[0].get_node()
    head = result.input(0).get_source_output().get_node()
    if (
        head.get_type_name() != "MatMul"
        or head.get_attributes().get("transpose_a")
        or head.input(0).get_partial_shape().rank.get_length() != 3
    ):
        return False
    keep = ops.parameter([1], ov.Type.i64, name=LOGITS_KEEP)
    keep.output(0).get_tensor().set_names({LOGITS_KEEP})
    last_rows = ops.slice(
        head.input(0).get_source_output(),
        ops.negative(keep),
        ops.constant(np.asarray([np.iinfo(np.int64).max], np.int64)),
        ops.constant(np.asarray([1], np.int64)),
        ops.constant(np.asarray([1], np.int64)),
    )
    head.input(0).replace_source_output(last_rows.output(0))
    model.add_parameters([keep])
    model.validate_nodes_and_infer_types()
    return True


def property_text(value: object) -> str:
    """A property value as plain text: "f32" rather than "<Type: 'float32'>", "CPU" rather than
    "['CPU']"."""
    if hasattr(value, "get_type_name"):
        return str(value.get_type_name())
    if isinstance(value, (list, tuple)):
        return ",".join(property_text(item) for item in value)
    return (
        str(getattr(value, "name", value))
        if hasattr(value, "name") and not isinstance(value, str)
        else str(value)
    )


def requested_properties(
    core: Any,
    device: str,
    threads: int,
    inference_precision: str | None,
    kv_cache_precision: str | None,
    weights: str,
) -> dict[str, object]:
    """The properties to compile with, of those the device supports (the others are logged and
    left)."""
    supported = set(core.get_property(device, "SUPPORTED_PROPERTIES"))
    wanted: dict[str, object] = {"NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
    if inference_precision:
        wanted["INFERENCE_PRECISION_HINT"] = inference_precision
    if kv_cache_precision:
        wanted["KV_CACHE_PRECISION"] = kv_cache_precision
    if threads > 0:
        wanted["INFERENCE_NUM_THREADS"] = threads
    properties = {}
    for key, value in wanted.items():
        if key in supported:
            properties[key] = value
        else:
            logger.warning("%s does not support %s; using its default", device, key)
    if device == "CPU" and threads == 1 and weights in ("fp32", "fp16"):
        capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        hint = inference_precision or ("bf16" if "BF16" in capabilities else "f32")
        if hint == "bf16":
            # The CPU plugin dies with SIGFPE in compile_model for this combination (field notes).
            raise EngineError(
                "threads=1 with bf16 inference on fp32/fp16 weights crashes the CPU plugin; "
                "set inference_precision to f32 or f16"
            )
    return properties
