"""The architecture of a GGUF model from its header (key/value metadata and tensor names; no
weights read)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from fleettui.errors import PlanError
from fleettui.model.shape import ModelShape

# The GGUF architectures shard_compiler compiles (shard_compiler.families.GGUF_FAMILIES; a test
# keeps the two in step): their GGUF metadata keys all follow "<architecture>.<key>".
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "qwen3moe")
# every sixth Gemma 3 layer is global; llama.cpp fixes it too (the GGUF does not store it)
GEMMA3_PATTERN = 6

_GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def _gguf_value(stream: BinaryIO, kind: int) -> Any:
    if kind in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[kind]
        return struct.unpack(fmt, stream.read(struct.calcsize(fmt)))[0]
    if kind == 8:
        (length,) = struct.unpack("<Q", stream.read(8))
        return stream.read(length).decode("utf-8", "replace")
    if kind == 9:
        item_kind, count = struct.unpack("<IQ", stream.read(12))
        if item_kind in _GGUF_SCALARS:  # skip numeric arrays without decoding them
            stream.seek(count * struct.calcsize(_GGUF_SCALARS[item_kind]), 1)
            return count
        for _ in range(count):
            _gguf_value(stream, item_kind)
        return count
    raise ValueError(f"unknown GGUF value type {kind}")


def gguf_shape(path: Path) -> ModelShape:
    """Read the architecture from a GGUF header (key/value metadata and tensor names)."""
    try:
        with open(path, "rb") as stream:
            magic, _version, tensors, pairs = struct.unpack("<4sIQQ", stream.read(24))
            if magic != b"GGUF":
                raise ValueError("not a GGUF file")
            meta = {}
            for _ in range(pairs):
                (length,) = struct.unpack("<Q", stream.read(8))
                key = stream.read(length).decode("utf-8", "replace")
                (kind,) = struct.unpack("<I", stream.read(4))
                meta[key] = _gguf_value(stream, kind)
            names = set()
            for _ in range(tensors):
                (length,) = struct.unpack("<Q", stream.read(8))
                names.add(stream.read(length).decode("utf-8", "replace"))
                (dims,) = struct.unpack("<I", stream.read(4))
                stream.seek(8 * dims + 4 + 8, 1)
    except (OSError, ValueError, struct.error) as error:
        raise PlanError(f"{path}: cannot read GGUF metadata: {error}") from None
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise PlanError(f"{path}: unsupported architecture {arch!r} (supported: {supported})")
    try:
        heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        layers = int(meta[f"{arch}.block_count"])
        window = int(meta.get(f"{arch}.attention.sliding_window") or 0) if arch == "gemma3" else 0
        experts = int(meta.get(f"{arch}.expert_count") or 0)
        return ModelShape(
            name=str(meta.get("general.name") or path.stem),
            num_layers=layers,
            hidden=hidden,
            intermediate=int(meta[f"{arch}.feed_forward_length"]),
            heads=heads,
            kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
            vocab=int(meta.get(f"{arch}.vocab_size") or meta["tokenizer.ggml.tokens"]),
            tied_embeddings="output.weight" not in names,
            sliding_window=window,
            local_layers=tuple(i for i in range(layers) if (i + 1) % GEMMA3_PATTERN)
            if window
            else (),
            experts=experts,
            experts_per_token=int(meta.get(f"{arch}.expert_used_count") or 0) if experts else 0,
            expert_intermediate=int(meta.get(f"{arch}.expert_feed_forward_length") or 0)
            if experts
            else 0,
        )
    except KeyError as error:
        raise PlanError(f"{path}: GGUF metadata lacks {error.args[0]}") from None
