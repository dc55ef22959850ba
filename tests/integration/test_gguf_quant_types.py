"""A GGUF with a tensor type the compiler cannot read: one line naming the file and the type, exit
2, and no shard folder left in the cache. Gemma-3-270M's own types (Q4_K, Q5_0, Q6_K, Q8_0, F32) all
read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shard_compiler.conformance import entries
from shard_compiler.sources import READABLE_GGUF_TYPES
from tests.support.tiny_models import write_gguf


def _with_a_q8_1_tensor(path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny llama GGUF with blk.0.ffn_up.weight stored as Q8_1 (a type gguf-py cannot
    dequantise)."""
    import gguf

    original = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None):  # type: ignore[no-untyped-def]
        if name != "blk.0.ffn_up.weight":
            return original(self, name, tensor, raw_shape, raw_dtype)
        rows, columns = tensor.shape
        # 32 weights in 40 bytes a block
        blocks = np.zeros((rows, columns // 32 * 40), dtype=np.uint8)
        return original(self, name, blocks, blocks.shape, gguf.GGMLQuantizationType.Q8_1)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    try:
        return write_gguf(entries()["llama"], path)
    finally:
        monkeypatch.undo()


@pytest.mark.slow
def test_an_unreadable_quant_type_is_one_line_naming_file_and_type(
    tmp_path: Path, monkeypatch
) -> None:
    model = _with_a_q8_1_tensor(tmp_path / "odd.gguf", monkeypatch)
    cache = tmp_path / "cache"
    command = [
        sys.executable,
        "-m",
        "shard_compiler",
        "--model",
        str(model),
        "--stages",
        "2",
        "--precision",
        "fp32",
    ]
    result = subprocess.run(
        [*command, "--cache-root", str(cache)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"shard_compiler: error: {model}: tensor 'blk.0.ffn_up.weight' is stored as Q8_1"
    )
    assert not [p for p in (cache / "shards").glob("*") if not p.name.startswith(".")]


@pytest.mark.slow
def test_the_packaged_gemma_uses_only_readable_types() -> None:
    import gguf

    from tests.support.gemma import gguf_path

    kinds = {tensor.tensor_type.name for tensor in gguf.GGUFReader(str(gguf_path())).tensors}
    assert kinds == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"} and kinds <= READABLE_GGUF_TYPES
