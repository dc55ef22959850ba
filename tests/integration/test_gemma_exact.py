"""Gemma-3-270M end to end through the CLI: `fleettui ask --raw --exact` on two stages (cut inside
the local/global pattern) gives the tokens of transformers' fp32 greedy decoding of the dequantised
GGUF."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleettui.control.deployment import free_port_block
from tests.support.gemma import gguf_path, reference_tokenizer
from tests.support.shards import session_cache_root

pytestmark = pytest.mark.slow
TOKENS = 64
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Zürich, Kraków and São Paulo are cities where",
)


def fleettui(*arguments: str, timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fleettui", *arguments]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def transformers_greedy() -> list[list[int]]:
    """transformers' fp32 greedy continuation of each prompt, bos first as the GGUF asks (its own
    EOS stops it).

    The weights are those transformers' GGUF reader dequantised for the compile (cached under the
    GGUF's content hash), so the file is read once a run; the forward and the decoding are
    transformers' own."""
    import torch
    from transformers import AutoModelForCausalLM

    from shard_compiler import sources

    root = session_cache_root()
    source = sources.resolve(str(gguf_path()), root)
    directory = root / "sources" / sources.source_hash(source, root)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    tokenizer = reference_tokenizer()
    answers = []
    for prompt in PROMPTS:
        ids = [2, *tokenizer(prompt, add_special_tokens=False).input_ids]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False)
        # without the final <eos>
        answers.append([int(t) for t in out[0][len(ids) :] if int(t) != 1])
    return answers


def test_ask_raw_exact_on_two_stages_equals_transformers(tmp_path: Path) -> None:
    fleet = tmp_path / "gemma.toml"
    hosts = "".join(
        f'[[hosts]]\nname = "stage-{i}"\nbase_port = {free_port_block()}\nlayers = [{start}, '
        f"{end}]\n"
        for i, (start, end) in enumerate(((0, 9), (9, 18)))
    )
    fleet.write_text(
        f'[model]\nname = "gemma-3-270m"\nshards = "{session_cache_root()}"\n'
        '[speculation]\ndraft = "prompt-lookup"\n[resilience]\ncalibrate = "off"\n' + hosts
    )
    deployed = fleettui("deploy", str(fleet), "--exact")
    assert deployed.returncode == 0, deployed.stderr[-2000:]
    try:
        reference = transformers_greedy()
        for prompt, expected in zip(PROMPTS, reference, strict=True):
            asked = fleettui(
                "ask",
                str(fleet),
                "--raw",
                "--exact",
                "--max-tokens",
                str(TOKENS),
                "--json",
                "-",
                prompt,
            )
            assert asked.returncode == 0, asked.stderr[-2000:]
            answer = json.loads(asked.stdout)
            assert answer["fleet"]["stages"] == [[0, 9], [9, 18]] and answer["fleet"]["attached"]
            assert [t for t in answer["token_ids"] if t != 1] == expected, prompt
        served(fleet, reference[0])
        refused = fleettui("ask", str(fleet), "--exact", "What is the capital of France?")
        assert refused.returncode == 2
        assert (
            refused.stderr.strip()
            .splitlines()[-1]
            .endswith(
                "gemma-3-270m has no chat template (a base model): send a raw prompt "
                "(/v1/completions, "
                "`fleettui ask --raw`)"
            )
        )
    finally:
        stopped = fleettui("stop", str(fleet))
        assert stopped.returncode == 0, stopped.stderr[-2000:]


def served(fleet: Path, expected: list[int]) -> None:
    """`fleettui serve` on the deployment: /v1/completions continues the prompt; a chat request
    is a 400."""
    import httpx
    import jsonschema

    command = [sys.executable, "-m", "fleettui", "serve", str(fleet), "--exact", "--port", "0"]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        assert process.stderr is not None
        lines: list[str] = []
        while not (lines and lines[-1].startswith("fleettui serve: ")) and len(lines) < 50:
            lines.append(process.stderr.readline())
            assert lines[-1], "".join(lines)  # the command died before it was ready
        base = lines[-1].split()[2]  # http://127.0.0.1:PORT/v1
        body = {"model": "gemma-3-270m", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        completion = httpx.post(f"{base}/completions", json=body, timeout=300)
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 16
        assert completion.json()["choices"][0]["text"] == reference_tokenizer().decode(
            expected[:16]
        )
        # a base model's completion held to a JSON schema: valid by construction, or finish_reason
        # length
        schema = {
            "type": "object",
            "properties": {
                "country": {"enum": ["France", "Italy", "Spain"]},
                "capital": {"type": "boolean"},
            },
            "required": ["country", "capital"],
            "additionalProperties": False,  # a base model would otherwise add keys until max_tokens
        }
        shaped = {
            "model": "gemma-3-270m",
            "prompt": "Paris is in",
            "max_tokens": 40,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": schema},
            },
        }
        constrained = httpx.post(f"{base}/completions", json=shaped, timeout=300)
        assert constrained.status_code == 200, constrained.text
        choice = constrained.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), schema)
        chat = {
            "model": "gemma-3-270m",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
        }
        refused = httpx.post(f"{base}/chat/completions", json=chat, timeout=60)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (
            error["param"] == "messages"
            and "has no chat template (a base model)" in error["message"]
        )
    finally:
        process.terminate()
        process.wait(timeout=60)
