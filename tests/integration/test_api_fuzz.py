"""Fuzzes a real `fleettui serve` (two real ZeroMQ stages of the real model) from its own
/openapi.json with schemathesis: no 5xx, responses as documented, schema-valid requests answered and
invalid ones refused; then the server and the same workers are alive and the greedy answer equals
the one given before the fuzzing.

The run is bounded: FUZZ_EXAMPLES examples per operation and phase (coverage, fuzzing), a 4-token
budget per request (tests/support/api_fuzz_hooks.py), a fixed seed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from fleettui.control.deployment import free_port_block
from tests.support.processes import worker_children

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("api_fuzz")]
ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
FUZZ_EXAMPLES = 25
FUZZ_SEED = 3
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
    "response_headers_conformance,negative_data_rejection,positive_data_acceptance,unsupported_method,"
    "missing_required_header,allow_header_conformance"
)
QUESTION = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 12,
    "temperature": 0,
}


@dataclass
class Served:
    process: subprocess.Popen[str]
    base: str  # http://127.0.0.1:PORT
    workers: list[int]


@pytest.fixture(scope="module")
def served(shard_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("fuzz")
    fleet_file = folder / "fleet.toml"
    fleet_file.write_text(
        f'[model]\nname = "{MODEL}"\nshards = "{shard_cache}"\n[speculation]\ndraft = "none"\n'
        f'[[hosts]]\nname = "a"\nbase_port = {free_port_block()}\n'
        f'[[hosts]]\nname = "b"\nbase_port = {free_port_block()}\n'
    )
    command = [sys.executable, "-m", "fleettui", "serve", str(fleet_file), "--exact", "--port", "0"]
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stderr is not None
        output: list[str] = []
        while not (output and output[-1].startswith("fleettui serve: ")) and len(output) < 80:
            output.append(process.stderr.readline())
            assert output[-1], "".join(output)  # the command died before it was ready
        base = output[-1].split()[2].removesuffix("/v1")
        workers = sorted(child.pid for child in worker_children(psutil.Process(process.pid)))
        assert len(workers) == 2
        yield Served(process, base, workers)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def ask(base: str) -> str:
    reply = httpx.post(f"{base}/v1/chat/completions", json=QUESTION, timeout=300)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def test_schemathesis_finds_nothing_and_the_fleet_answers_as_before(
    served: Served, tmp_path: Path
) -> None:
    before = ask(served.base)
    assert "Paris" in before
    document = httpx.get(f"{served.base}/openapi.json", timeout=30).json()
    assert document["openapi"].startswith("3.") and "/v1/chat/completions" in document["paths"]
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("st")),
            "run",
            f"{served.base}/openapi.json",
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            str(FUZZ_EXAMPLES),
            "--seed",
            str(FUZZ_SEED),
            "--workers",
            "1",
            "--request-timeout",
            "120",
            "--checks",
            CHECKS,
            "--suppress-health-check",
            "all",
            "--report",
            "ndjson",
            "--report-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "SCHEMATHESIS_HOOKS": "tests.support.api_fuzz_hooks",
        },
    )
    summary = run.stdout[-6000:]
    assert run.returncode == 0, summary
    generated = [line for line in run.stdout.splitlines() if " generated" in line]
    # e.g. "155 generated, 0 found ..." for the record of this run
    print("schemathesis:", *generated)
    # the server and the very same workers are alive, and the fleet answers as before
    assert served.process.poll() is None
    health = httpx.get(f"{served.base}/health", timeout=30)
    assert health.status_code == 200 and json.loads(health.text)["status"] == "ok"
    assert (
        sorted(child.pid for child in worker_children(psutil.Process(served.process.pid)))
        == served.workers
    )
    assert ask(served.base) == before
