"""Provides the baseline rows: mono (`remote_worker.mono`) or GenAI (`shard_compiler.anchors`) in
a child process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from fleettui.bench.machine import CpuWitness
from fleettui.bench.report import short_precisions
from fleettui.bench.results import Row
from fleettui.bench.rows import RowSpec, new_row
from fleettui.config.fleet import Fleet
from fleettui.errors import child_failure

ROW_TIMEOUT = 900.0


async def run_baseline(
    spec: RowSpec, shard_dir: Path, prompt: list[int], tokens: int, fleet: Fleet
) -> Row:
    """mono (remote_worker.mono) or GenAI (shard_compiler.anchors) in a child process; a pinned mono
    with `copies` > 1 runs that many children at once, one per core, and sums their rates."""
    row = new_row(spec)
    row.details["device"] = spec.device
    module = "remote_worker.mono" if spec.kind == "mono" else "shard_compiler.anchors"
    command = [
        sys.executable,
        "-m",
        module,
        "--shard",
        str(shard_dir),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--tokens",
        str(tokens),
        "--device",
        spec.device,
        "--json",
    ]
    runtime = fleet.runtime
    if runtime.inference_precision != "auto":
        command += ["--inference-precision", runtime.inference_precision]
    if runtime.kv_cache_precision != "auto":
        command += ["--kv-cache-precision", runtime.kv_cache_precision]
    cores = sorted(os.sched_getaffinity(0))
    if spec.pinned:
        command += ["--threads", "1"]
    witness = CpuWitness()
    # GenAI assembles a model folder; a child killed (a timeout, a SIGTERM to the bench) cannot
    # remove it
    folder = tempfile.TemporaryDirectory(prefix="fleettui-genai-") if spec.kind != "mono" else None
    with folder or contextlib.nullcontext() as scratch:
        if scratch is not None:
            command += ["--scratch", scratch]
        if spec.copies > 1:
            commands = [
                command + ["--cores", str(cores[i % len(cores)]), "--wait-for-go"]
                for i in range(spec.copies)
            ]
            outputs = await asyncio.wait_for(run_children(commands, together=True), ROW_TIMEOUT)
        else:
            command += ["--cores", str(cores[0])] if spec.pinned else []
            outputs = await asyncio.wait_for(run_children([command]), ROW_TIMEOUT)
    # over the whole child run (compile and warm-up too)
    row.details["others_cpu"] = witness.others()
    results = []
    for returncode, stdout, stderr in outputs:
        if returncode != 0:
            row.status = f"failed: {child_failure(stderr, returncode)}"
            return row
        result = json.loads(stdout.strip().splitlines()[-1])
        if "skipped" in result:
            row.status = f"skipped: {result['skipped']}"
            return row
        results.append(result)
    first = results[0]
    # the middle of its timed decode, wall clock (its pairs are taken at the same time:
    # `paired_rates`)
    middles = [r["started_at"] + r["seconds"] / 2 for r in results if "started_at" in r]
    row.details["at"] = sum(middles) / len(middles) if middles else None
    row.precision = short_precisions(first["precision"])
    row.tokens = sum(result["tokens"] for result in results)
    row.seconds = max(result["seconds"] for result in results)
    row.ttft_s = sum(result["ttft_s"] for result in results) / len(results)
    row.aggregate_tok_s = sum(result["tok_s"] for result in results)
    row.per_user_tok_s = row.aggregate_tok_s / len(results)
    row.details.update({key: first[key] for key in ("threads", "cores", "backend") if key in first})
    if len(results) > 1:
        row.details["cores"] = [core for result in results for core in result.get("cores", [])]
        row.details["copies_tok_s"] = [round(result["tok_s"], 2) for result in results]
        row.details["copies_windows"] = [
            [round(result["started_at"], 3), round(result["started_at"] + result["seconds"], 3)]
            for result in results
        ]
    return row


async def run_children(
    commands: list[list[str]], together: bool = False
) -> list[tuple[int, str, str]]:
    """Run the children to their end; (returncode, stdout, stderr) each. `together`: they are
    `--wait-for-go` children, let compile and warm up, then released at once (a line on each stdin)
    so their timed decodes overlap. Every child is killed if this is cancelled (a SIGTERM to the
    bench) or times out."""
    children: list[asyncio.subprocess.Process] = []
    try:
        for command in commands:
            children.append(
                await asyncio.create_subprocess_exec(
                    *command,
                    stdin=asyncio.subprocess.PIPE if together else asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
            )
        ready = [b""] * len(children)
        if together:
            ready = [await child.stdout.readline() for child in children]  # type: ignore[union-attr]
            for child, line in zip(children, ready, strict=True):
                if b'"ready"' in line:
                    child.stdin.write(b"go\n")  # type: ignore[union-attr]
                child.stdin.close()  # type: ignore[union-attr]  # a child that is not ready sees EOF and ends
        finished = [await child.communicate() for child in children]
        return [
            (int(child.returncode or 0), line.decode() + out.decode(), err.decode())
            for child, line, (out, err) in zip(children, ready, finished, strict=True)
        ]
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
