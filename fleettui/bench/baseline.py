"""Provides the baseline rows: mono (`remote_worker.mono`) or GenAI (`shard_compiler.anchors`) in a child process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from fleettui.bench.machine import CpuWitness
from fleettui.bench.report import short_precisions
from fleettui.bench.results import Row
from fleettui.bench.rows import RowSpec, new_row
from fleettui.config.fleet import Fleet

ROW_TIMEOUT = 900.0


async def run_baseline(spec: RowSpec, shard_dir: Path, prompt: list[int], tokens: int, fleet: Fleet) -> Row:
    """mono (remote_worker.mono) or GenAI (shard_compiler.anchors) in a child process."""
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
    if spec.pinned:
        command += ["--threads", "1", "--cores", str(sorted(os.sched_getaffinity(0))[0])]
    runtime = fleet.runtime
    if runtime.inference_precision != "auto":
        command += ["--inference-precision", runtime.inference_precision]
    if runtime.kv_cache_precision != "auto":
        command += ["--kv-cache-precision", runtime.kv_cache_precision]
    witness = CpuWitness()
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=ROW_TIMEOUT
    )
    row.details["others_cpu"] = witness.others()  # over the whole child run (compile and warm-up too)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        row.status = f"failed: {lines[-1] if lines else f'exit code {done.returncode}'}"
        return row
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skipped" in result:
        row.status = f"skipped: {result['skipped']}"
        return row
    row.precision = short_precisions(result["precision"])
    row.tokens, row.seconds, row.ttft_s = result["tokens"], result["seconds"], result["ttft_s"]
    row.aggregate_tok_s = row.per_user_tok_s = result["tok_s"]
    row.details.update({key: result[key] for key in ("threads", "cores", "backend") if key in result})
    return row
