"""A valid manifest over small stand-in files (no model): for tests of the manifest contract and
of pushes."""

from __future__ import annotations

from pathlib import Path

from remote_worker.manifest import (
    FORMAT_VERSION,
    Manifest,
    StageSpec,
    TensorSpec,
    ranges_from_splits,
    sha256_file,
)


def stage_files(directory: Path, index: int) -> dict[str, str]:
    files = {}
    for name, content in (
        ("openvino_model.xml", f"<xml {index}/>"),
        ("openvino_model.bin", f"weights {index}"),
    ):
        path = directory / f"stage_{index}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        files[f"stage_{index}/{name}"] = sha256_file(path)
    return files


def fake_manifest(directory: Path, splits: tuple[int, ...] = (0, 16, 30)) -> Manifest:
    tokenizer = directory / "tokenizer" / "tokenizer.json"
    tokenizer.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.write_text("{}")
    stages = []
    for index, layers in enumerate(ranges_from_splits(splits, 30)):
        first = (
            TensorSpec("input_ids", "i64", (1, "n"), "ids")
            if layers.is_first
            else TensorSpec("hidden_states", "f32", (1, "n", 576), "hidden")
        )
        stages.append(
            StageSpec(
                index=index,
                layers=layers,
                num_layers=30,
                ir=f"stage_{index}/openvino_model.xml",
                inputs=(first, TensorSpec("attention_mask", "i64", (1, "cache_len + n"), "mask")),
                outputs=(TensorSpec("logits", "f32", (1, "n", 49152), "logits"),),
                state_names=tuple(
                    f"layer{layer}.{kind}"
                    for layer in range(layers.start, layers.end)
                    for kind in "kv"
                ),
                files=stage_files(directory, index),
            )
        )
    return Manifest(
        format_version=FORMAT_VERSION,
        model_name="smollm2-135m-instruct",
        source="gguf:/x.gguf",
        source_hash="ab" * 32,
        compiler_version="2",
        cache_key="0123456789abcdef",
        precision="int4",
        weight_group_size=64,
        num_layers=30,
        hidden_size=576,
        vocab_size=49152,
        num_attention_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0},
        max_position_embeddings=8192,
        tokenizer="tokenizer",
        chat_template="{{ messages }}",
        bos_token_id=1,
        eos_token_ids=(2,),
        pad_token_id=None,
        stages=tuple(stages),
        shared_files={"tokenizer/tokenizer.json": sha256_file(tokenizer)},
        created_at="2026-11-30T08:00:00+00:00",
    )


def rot_behind_the_stamp(folder: Path, relative: str, stamp: Path) -> None:
    """Bit rot: the file's bytes change (same size), and its stamp record is made to match its
    metadata again, as when a disk corrupts data without any write through the file system (no ctime
    change)."""
    import json

    path = folder / relative
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    record = json.loads(stamp.read_text())
    info = path.stat()
    sha = record["files"][relative][0]
    record["files"][relative] = [
        sha,
        info.st_size,
        info.st_mtime_ns,
        info.st_ctime_ns,
        info.st_ino,
        info.st_dev,
    ]
    stamp.write_text(json.dumps(record))
