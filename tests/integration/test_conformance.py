"""The conformance harness: every architecture of shard_compiler.conformance.REGISTRY, written as
safetensors and as GGUF, compiled to 1, 2 and 3 stages in f32, gives transformers' own next-token
logits on every step.

Each run decodes a prompt plus 40 greedy tokens through the stage IRs chained in process, and every
few steps forces a rollback the way speculation does: three draft tokens are fed and then masked out
(they stay in the KV cache), and the next token takes the first rejected one's logical position. The
reference is one forward of transformers' model over the accepted tokens. Gemma 3's window of 4 is
passed many times over, by logical positions that the rejected slots must not count in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from remote_worker.manifest import load_manifest
from shard_compiler.conformance import REGISTRY, Entry
from tests.support import tiny_models

GENERATED = 40
TOLERANCE = 1e-4
PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43]
CASES = [
    pytest.param(entry, kind, split, id=f"{entry.key}-{kind}-{len(split) - 1}stage")
    for entry in REGISTRY
    for kind in entry.formats
    for split in entry.splits
]


class Chain:
    """The stage IRs of one compile chained in process (f32 inference, f32 KV cache), mask
    bookkeeping kept."""

    def __init__(self, shard_dir: Path) -> None:
        import openvino as ov

        manifest = load_manifest(shard_dir)
        core = ov.Core()
        settings = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
        self.requests = [
            core.compile_model(str(shard_dir / stage.ir), "CPU", settings).create_infer_request()
            for stage in manifest.stages
        ]
        self.mask: list[int] = []

    def step(self, ids: list[int], first_position: int) -> np.ndarray:
        self.mask += [1] * len(ids)
        data: Any = np.array([ids], dtype=np.int64)
        for request in self.requests:
            names = {port.get_any_name() for port in request.model_inputs}
            inputs = {
                "input_ids" if "input_ids" in names else "hidden_states": data,
                "attention_mask": np.array([self.mask], dtype=np.int64),
                "position_ids": np.arange(
                    first_position, first_position + len(ids), dtype=np.int64
                )[None],
                "beam_idx": np.zeros(1, dtype=np.int32),
            }
            request.infer(inputs)
            data = request.get_output_tensor(0).data.copy()
        return data[0]

    def reject_last(self, count: int) -> None:
        self.mask[-count:] = [0] * count


def decode_with_rollbacks(chain: Chain) -> tuple[list[int], np.ndarray, int]:
    """Prompt + GENERATED greedy tokens with a forced rollback every 5th step: (tokens, logits
    per row, rollbacks)."""
    rows = [chain.step(PROMPT, 0)]
    sequence = list(PROMPT)
    rollbacks = 0
    for index in range(GENERATED):
        token = int(np.argmax(rows[-1][-1]))
        if index % 5 == 2:
            drafts = [(token + offset) % 256 for offset in (1, 2, 3)]  # fed, then rejected
            chain.step(drafts, len(sequence))
            chain.reject_last(len(drafts))
            rollbacks += 1
        rows.append(chain.step([token], len(sequence)))
        sequence.append(token)
    return sequence, np.concatenate(rows)[: len(sequence)], rollbacks


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance")


_sources: dict[tuple[str, str], Path] = {}


def source(entry: Entry, kind: str, workspace: Path) -> Path:
    """ENTRY's tiny model written once per run in KIND (hf: save_pretrained folder, gguf: an f32
    GGUF)."""
    key = (entry.key, kind)
    if key not in _sources:
        folder = workspace / entry.key
        if kind == "hf":
            _sources[key] = tiny_models.write_hf(entry, folder / "hf")
        else:
            _sources[key] = tiny_models.write_gguf(entry, folder / f"tiny-{entry.key}.gguf")
    return _sources[key]


@pytest.mark.slow
@pytest.mark.parametrize(("entry", "kind", "split"), CASES)
def test_logits_equal_transformers(
    entry: Entry, kind: str, split: tuple[int, ...], workspace: Path
) -> None:
    import torch

    from shard_compiler.compiler import compile_shards

    shard_dir = compile_shards(
        str(source(entry, kind, workspace)),
        stages=list(split),
        precision="fp32",
        cache_root=workspace / "cache",
    )
    assert [str(stage.layers) for stage in load_manifest(shard_dir).stages] == [
        f"[{start}, {end})" for start, end in zip(split, split[1:], strict=False)
    ]
    sequence, logits, rollbacks = decode_with_rollbacks(Chain(shard_dir))
    with torch.no_grad():
        reference = tiny_models.model(entry)(torch.tensor([sequence])).logits[0].numpy()
    difference = float(np.abs(logits - reference).max())
    print(f"{entry.key} {kind} {len(split) - 1} stages: max |logit diff| {difference:.2e}")
    assert rollbacks == 8 and len(sequence) == len(PROMPT) + GENERATED
    assert difference <= TOLERANCE
    generated = sequence[len(PROMPT) :]
    assert generated == [int(np.argmax(row)) for row in reference[len(PROMPT) - 1 : -1]]


def test_an_unsupported_architecture_is_one_line(tmp_path: Path) -> None:
    import json

    from shard_compiler.compiler import compile_shards
    from shard_compiler.sources import CompileError

    folder = tmp_path / "olmo2"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]})
    )
    with pytest.raises(
        CompileError, match=r"config.json: unsupported architecture 'Olmo2ForCausalLM'"
    ):
        compile_shards(str(folder), precision="fp32", cache_root=tmp_path / "cache")
    entry = next(entry for entry in REGISTRY if entry.model_type == "qwen3")
    path = tiny_models.write_gguf(entry, tmp_path / "falcon.gguf", arch_name="falcon")
    with pytest.raises(CompileError) as caught:
        compile_shards(str(path), precision="fp32", cache_root=tmp_path / "cache")
    assert str(caught.value).startswith(f"{path}: unsupported architecture 'falcon' (supported: ")
    assert "\n" not in str(caught.value)


def test_an_unreadable_quant_type_is_one_line_and_leaves_no_shards(tmp_path: Path) -> None:
    import gguf

    from shard_compiler.compiler import compile_shards
    from shard_compiler.sources import CompileError

    entry = next(entry for entry in REGISTRY if entry.model_type == "qwen3")
    path = tiny_models.write_gguf(
        entry, tmp_path / "q81.gguf", raw={"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q8_1}
    )
    with pytest.raises(CompileError) as caught:
        compile_shards(str(path), stages=2, precision="fp32", cache_root=tmp_path / "cache")
    assert str(caught.value) == (
        f"{path}: tensor 'blk.0.attn_q.weight' is stored as Q8_1, a quantisation type the compiler "
        "cannot read"
    )
    shards = tmp_path / "cache" / "shards"
    assert not shards.exists() or not any(shards.iterdir())


def test_the_readme_lists_what_the_harness_covers() -> None:
    from shard_compiler.conformance import covered_architectures, markdown
    from shard_compiler.families import FAMILIES

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert markdown() in readme  # regenerate with: python -m shard_compiler.conformance
    assert covered_architectures() == list(FAMILIES)  # no family without a harness entry
