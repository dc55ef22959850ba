"""Tests the shard compiler on the real SmolLM2 model: CLI errors, tokenizer, exactness, HF
parity, caching."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from remote_worker.manifest import load_manifest, verify_all
from tests.support.shards import (
    PROMPTS,
    ChainRunner,
    chat_ids,
    chat_text,
    compiled,
    gguf_location,
    reference_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
EXACT_TOKENS = 64


def run_cli(*arguments: str, cache_root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shard_compiler", *arguments, "--cache-root", str(cache_root)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    return lines[0]


# ----------------------------------------------------------------------------------- CLI errors
def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    line = one_line_error(
        run_cli("--model", str(folder), "--precision", "fp32", cache_root=tmp_path)
    )
    assert "unsupported architecture 'GPT2LMHeadModel'" in line and "config.json" in line


def test_bad_precision_name(tmp_path: Path) -> None:
    line = one_line_error(
        run_cli("--model", "smollm2-135m-instruct", "--precision", "int3", cache_root=tmp_path)
    )
    assert "precision 'int3'" in line and "int4" in line


def test_missing_model(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    line = one_line_error(
        run_cli("--model", str(missing), "--precision", "fp32", cache_root=tmp_path)
    )
    assert str(missing) in line and "no such file" in line


def test_bad_split() -> None:
    from tests.support.shards import session_cache_root

    arguments = ("--model", "smollm2-135m-instruct", "--split", "0,10,31")
    line = one_line_error(run_cli(*arguments, cache_root=session_cache_root()))
    assert "0,10,31" in line and "30" in line


def test_a_split_inside_a_layer_must_be_at_its_middle() -> None:
    from tests.support.shards import session_cache_root

    line = one_line_error(
        run_cli(
            "--model",
            "smollm2-135m-instruct",
            "--split",
            "0,12.3,30",
            cache_root=session_cache_root(),
        )
    )
    assert "12.3" in line and "N.5 to cut inside layer N" in line


# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def fp32_shards() -> dict[int, Path]:
    return {stages: compiled(stages, "fp32") for stages in (1, 2, 3)}


@pytest.fixture(scope="module")
def reference_tokens(fp32_shards: dict[int, Path]) -> list[list[int]]:
    runner = ChainRunner(fp32_shards[1], exact=True)
    return [runner.greedy(chat_ids(fp32_shards[1], prompt), EXACT_TOKENS) for prompt in PROMPTS]


# ------------------------------------------------------------------------------------ tokenizer
@pytest.mark.slow
def test_tokenizer_json_reproduces_the_gguf_tokenizer(fp32_shards: dict[int, Path]) -> None:
    from tokenizers import Tokenizer

    directory = fp32_shards[1]
    manifest = load_manifest(directory)
    exported = Tokenizer.from_file(str(directory / manifest.tokenizer / "tokenizer.json"))
    reference = reference_tokenizer()
    texts = [
        "Hello world, 12345 apples cost 3.50 dollars!",
        "  leading spaces and\ttabs\nnew lines",
        "naïve café – 東京 🙂 <|im_end|>",
        "def f(x):\n    return x ** 2  # 2024-11-30",
        *(chat_text(manifest, prompt) for prompt in PROMPTS),
    ]
    for text in texts:
        ids = exported.encode(text, add_special_tokens=False).ids
        assert ids == reference(text, add_special_tokens=False).input_ids, text
        assert exported.decode(ids, skip_special_tokens=False) == text
    # the GGUF says add_bos_token false: plain encoding must not prepend <|im_start|>
    assert exported.encode("Hi").ids == reference("Hi", add_special_tokens=False).input_ids
    assert manifest.eos_token_ids == (2,) and manifest.bos_token_id == 1
    assert chat_text(manifest, "x").endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------ exactness
@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_chained_fp32_shards_equal_the_unsplit_model(
    fp32_shards: dict[int, Path], reference_tokens: list[list[int]], stages: int
) -> None:
    manifest = load_manifest(fp32_shards[stages])
    assert [len(stage.layers) for stage in manifest.stages] == [30 // stages] * stages
    runner = ChainRunner(fp32_shards[stages], exact=True)
    for prompt, expected in zip(PROMPTS, reference_tokens, strict=True):
        assert runner.greedy(chat_ids(fp32_shards[stages], prompt), EXACT_TOKENS) == expected, (
            prompt
        )
    assert all(len(tokens) == EXACT_TOKENS for tokens in reference_tokens)


@pytest.mark.slow
def test_stages_cut_between_a_layers_attention_and_its_mlp_equal_the_unsplit_model(
    fp32_shards: dict[int, Path], reference_tokens: list[list[int]]
) -> None:
    """`--split 0,12.5,20.5,30`: layers 12 and 20 are cut after their attention (the KV cache stays
    with the attention, the next stage starts with the MLP). The same ops, only the graph is cut:
    bit-identical logits."""
    from tests.support.shards import session_cache_root

    result = run_cli(
        "--model",
        "smollm2-135m-instruct",
        "--split",
        "0,12.5,20.5,30",
        "--precision",
        "fp32",
        cache_root=session_cache_root(),
    )
    assert result.returncode == 0, result.stderr
    directory = Path(result.stdout.strip().splitlines()[-1])
    manifest = load_manifest(directory)
    assert [str(stage.layers) for stage in manifest.stages] == [
        "[0, 12.5)",
        "[12.5, 20.5)",
        "[20.5, 30)",
    ]
    assert manifest.mid_cuts == (13, 21) and manifest.splits == (0, 13, 21, 30)
    # K and V per layer held
    assert [len(stage.state_names) for stage in manifest.stages] == [
        26,
        16,
        18,
    ]
    cut, whole = ChainRunner(directory, exact=True), ChainRunner(fp32_shards[1], exact=True)
    for prompt, expected in zip(PROMPTS, reference_tokens, strict=True):
        ids = chat_ids(directory, prompt)
        assert np.array_equal(cut.step(ids), whole.step(ids)), prompt
        cut.reset()
        assert cut.greedy(ids, EXACT_TOKENS) == expected, prompt
        cut.reset()
        whole.reset()


@pytest.mark.slow
def test_manifest_describes_the_stages(fp32_shards: dict[int, Path]) -> None:
    import openvino as ov

    directory = fp32_shards[3]
    manifest = load_manifest(directory)
    verify_all(directory, manifest)
    assert (manifest.num_layers, manifest.hidden_size, manifest.vocab_size) == (30, 576, 49152)
    assert manifest.precision == "fp32" and manifest.weight_group_size is None
    core = ov.Core()
    for stage in manifest.stages:
        model = core.read_model(str(directory / stage.ir))
        assert {port.get_any_name() for port in model.inputs} == {
            tensor.name for tensor in stage.inputs
        }
        assert [port.get_any_name() for port in model.outputs] == [
            tensor.name for tensor in stage.outputs
        ]
        variables = {
            op.get_variable_id() for op in model.get_ops() if op.get_type_name() == "ReadValue"
        }
        assert variables == set(stage.state_names) and len(stage.state_names) == 2 * len(
            stage.layers
        )
        assert (
            stage.state_names[0]
            == f"past_key_values.{stage.layers.start}.keypresent.{stage.layers.start}.key"
        )
        gathers = [
            op
            for op in model.get_ops()
            if op.get_type_name() == "Gather"
            and op.input_value(0).get_node().get_type_name() == "ReadValue"
        ]
        assert len(gathers) == len(stage.state_names)  # the beam_idx Gather sits on every ReadValue
    first, middle, last = manifest.stages
    assert [t.name for t in first.inputs][0] == "input_ids" and first.outputs[
        0
    ].name == "output_hidden_states"
    assert [t.name for t in middle.inputs][0] == "hidden_states" and last.outputs[
        0
    ].name == "logits"


# --------------------------------------------------------------------------- transformers parity
@pytest.mark.slow
def test_fp32_matches_transformers(fp32_shards: dict[int, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = gguf_location()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    ids = chat_ids(fp32_shards[1], PROMPTS[0])
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
        generated = model.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=2
        )[0, len(ids) :].tolist()
    runner = ChainRunner(fp32_shards[1], exact=True)
    logits = runner.step(ids)
    error = float(np.abs(logits - expected).max())
    print(
        f"max abs logit error vs transformers fp32 (all {len(ids)} prompt positions): {error:.2e}"
    )
    assert error <= 1e-3
    tokens = runner.greedy(ids, 16, stop_at_eos=True)
    assert tokens == generated
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(fp32_shards[1] / "tokenizer" / "tokenizer.json"))
    assert tokenizer.decode(tokens, skip_special_tokens=True) == "The capital of France is Paris."


# -------------------------------------------------------------------------------------- int4
@pytest.mark.slow
def test_int4_shard_answers(tmp_path: Path) -> None:
    directory = compiled(1, "int4")
    manifest = load_manifest(directory)
    assert manifest.precision == "int4" and manifest.weight_group_size == 64
    runner = ChainRunner(directory, exact=True)
    tokens = runner.greedy(chat_ids(directory, PROMPTS[0]), 16, stop_at_eos=True)
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(directory / "tokenizer" / "tokenizer.json")).decode(tokens)
    assert "Paris" in text


# -------------------------------------------------------------------------------------- cache
@pytest.mark.slow
def answered_from_the_cache(directory: Path) -> None:
    """Ask the compiler again for the 1-stage fp32 shards in DIRECTORY: it answers from its
    cache."""
    from shard_compiler.compiler import compile_shards
    from tests.support.shards import session_cache_root

    events: list = []
    again = compile_shards(
        "smollm2-135m-instruct",
        stages=1,
        precision="fp32",
        cache_root=session_cache_root(),
        progress=events.append,
    )
    assert again == directory and [event.step for event in events] == ["cached"]


@pytest.mark.slow
def test_unchanged_request_is_a_verified_no_op(
    fp32_shards: dict[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from remote_worker import manifest as manifest_module
    from shard_compiler.compiler import compile_shards
    from tests.support.shards import session_cache_root

    directory = fp32_shards[1]

    def files() -> dict[
        Path, int
    ]:  # the shards' own files (the check's stamps are bookkeeping beside them)
        return {
            path: path.stat().st_mtime_ns
            for path in directory.rglob("*")
            if manifest_module.VERIFIED_FOLDER not in path.relative_to(directory).parts
        }

    before = files()
    answered_from_the_cache(directory)
    assert files() == before
    # that check stamped what it found intact, so the next reads no file (an 8B model's are
    # gigabytes, and every fleet start asks for its shards)
    hashed: list[Path] = []
    real = manifest_module.sha256_file
    monkeypatch.setattr(
        manifest_module, "sha256_file", lambda path: hashed.append(path) or real(path)
    )
    answered_from_the_cache(directory)
    assert hashed == [] and files() == before
    monkeypatch.undo()

    # a copy with one corrupted weight file is detected and rebuilt, never trusted
    copy = tmp_path / "copy"
    # the stamps too: but a copy is other files, so it is hashed again
    shutil.copytree(directory, copy)
    events: list = []
    assert (
        compile_shards(
            "smollm2-135m-instruct",
            stages=1,
            precision="fp32",
            cache_root=session_cache_root(),
            out=copy,
            progress=events.append,
        )
        == copy
    )
    assert [event.step for event in events] == ["cached"]
    weights = copy / "stage_0" / "openvino_model.bin"
    with open(weights, "r+b") as stream:
        stream.seek(4096)
        stream.write(b"\xff" * 16)
    events.clear()
    compile_shards(
        "smollm2-135m-instruct",
        stages=1,
        precision="fp32",
        cache_root=session_cache_root(),
        out=copy,
        progress=events.append,
    )
    steps = [event.step for event in events]
    assert "cached" not in steps and "save" in steps and steps[-1] == "done"
    verify_all(copy, load_manifest(copy))
    # no temporary dirs left behind
    assert not [path for path in tmp_path.iterdir() if path.name != "copy"]


@pytest.mark.slow
def test_a_cached_request_does_not_parse_the_gguf(
    fp32_shards: dict[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fleet start asks the compiler for its shards; when they are cached that costs no GGUF
    parse (its reader builds every field, the whole vocabulary included: 2 s for SmolLM2), the
    config derived at compile time serves. A damaged derived config is derived again; one of another
    architecture refused."""

    from shard_compiler import sources

    def parse(path: Path, keys: object) -> None:
        raise AssertionError(f"{path} parsed for {keys}")

    with monkeypatch.context() as patch:
        patch.setattr(sources, "gguf_metadata", parse)
        answered_from_the_cache(fp32_shards[1])

    source = sources.resolve("smollm2-135m-instruct")
    digest = sources.source_hash(source, tmp_path)
    derived = sources.raw_config(source, tmp_path, digest)
    cached = tmp_path / "sources" / digest / "config.json"
    cached.write_text("{damaged")
    assert sources.raw_config(source, tmp_path, digest) == derived
    cached.write_text(
        json.dumps({**derived, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(sources.CompileError, match="unsupported architecture 'GPT2LMHeadModel'"):
        sources.raw_config(source, tmp_path, digest)


@pytest.mark.slow
def test_interrupted_compile_leaves_nothing_that_looks_valid(tmp_path: Path) -> None:
    from shard_compiler.compiler import compile_shards
    from tests.support.shards import session_cache_root

    def interrupt(event) -> None:  # type: ignore[no-untyped-def]
        if event.step == "trace":
            raise KeyboardInterrupt

    target = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        compile_shards(
            "smollm2-135m-instruct",
            stages=2,
            precision="fp32",
            cache_root=session_cache_root(),
            out=target,
            progress=interrupt,
        )
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- other Llama-family checkpoints
TINY_ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_checkpoint(folder: Path, kind: str) -> Path:
    """A randomly initialised 4-layer HF checkpoint (safetensors) with SmolLM2's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if kind == "llama3":
        model = LlamaForCausalLM(
            LlamaConfig(**common, rope_parameters=TINY_ROPE_LLAMA3, tie_word_embeddings=False)
        )
    else:  # qwen2: q/k/v biases, tied embeddings
        model = Qwen2ForCausalLM(
            Qwen2Config(
                **common,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                tie_word_embeddings=True,
            )
        )
        with torch.no_grad():
            for layer in model.model.layers:  # random init leaves biases at 0: make them matter
                for projection in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    projection.bias.normal_(0, 0.5)
    model.eval().save_pretrained(folder)
    tokenizer = compiled(1, "fp32") / "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_hf_folder_checkpoints_match_transformers(tmp_path: Path, kind: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from shard_compiler.compiler import compile_shards

    folder = tiny_checkpoint(tmp_path / kind, kind)
    directory = compile_shards(
        str(folder), stages=2, precision="fp32", cache_root=tmp_path / "cache"
    )
    manifest = load_manifest(directory)
    assert [len(stage.layers) for stage in manifest.stages] == [2, 2]
    assert (manifest.rope_scaling or {}).get("rope_type") == (
        "llama3" if kind == "llama3" else None
    )
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 33, 34, 35]
    runner = ChainRunner(directory, exact=True)
    logits = [runner.step(ids[:6]), runner.step(ids[6:9]), runner.step(ids[9:])]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    error = float(np.abs(np.concatenate(logits) - expected).max())
    print(f"{kind}: max abs logit error vs transformers over prefill + 2 cached steps: {error:.2e}")
    assert error <= 1e-4 * max(1.0, float(np.abs(expected).max()))
