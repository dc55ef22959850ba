"""Provides the calibration run of compiled shards: what a stage really costs per decoded token and per prefill chunk.

    python -m remote_worker.profile --shard DIR [--stages 0,1,2] [--device CPU] [--threads T] [--cores 0]
        [--inference-precision f32] [--kv-cache-precision f32] [--context 128] [--tokens 24] [--chunk 128]

Prints one JSON object: per stage, its layers, whether it holds the embedding / the head, and the median
milliseconds (20th percentile) of a 1-token decode step after CONTEXT cached tokens and of one CHUNK-token
prefill. Inputs are random (ids or hidden states): cost does not depend on the values. Stages are stepped
round-robin in this process, exactly as a worker runs them (same StageEngine, same OpenVINO settings).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

NO_MASK = np.zeros((0, 2), np.int64)


def _inputs(engine: Any, count: int, generator: np.random.Generator) -> np.ndarray:
    if engine.is_first:
        return generator.integers(3, engine.manifest.vocab_size, count).astype(np.int64)
    return generator.standard_normal((count, engine.manifest.hidden_size)).astype(np.float32)


def time_stages(
    engines: list[Any], context: int = 128, tokens: int = 48, chunk: int = 128
) -> list[dict[str, Any]]:
    """Per engine: a low percentile (20th) of 1-token decode ms after CONTEXT tokens and of a CHUNK prefill.

    The engines are stepped round-robin, one decode step each per round, so every stage is timed in the
    same windows: load from other programs slows them alike and does not skew one stage against another.
    A low percentile rather than the median, since other programs only ever make a step slower.
    """
    generator = np.random.default_rng(0)
    for engine in engines:
        engine.open(1)
    try:
        for engine in engines:  # warm up and fill the context
            engine.step(1, 0, 0, NO_MASK, _inputs(engine, context, generator), keep_last=1)
        steps: list[list[float]] = [[] for _ in engines]
        for index in range(tokens + 2):
            position = context + index
            for engine, times in zip(engines, steps, strict=True):
                data = _inputs(engine, 1, generator)
                started = time.perf_counter()
                engine.step(1, position, position, NO_MASK, data)
                if index >= 2:  # the first steps after a prefill reallocate
                    times.append(time.perf_counter() - started)
        prefills: list[list[float]] = [[] for _ in engines]
        for _ in range(3):
            for engine, times in zip(engines, prefills, strict=True):
                engine.reset(1)
                data = _inputs(engine, chunk, generator)
                started = time.perf_counter()
                engine.step(1, 0, 0, NO_MASK, data, keep_last=1)
                times.append(time.perf_counter() - started)
    finally:
        for engine in engines:
            engine.close(1)
    results = []
    for engine, decode, prefill in zip(engines, steps, prefills, strict=True):
        stage = engine.stage
        low = float(np.percentile(decode, 20))
        results.append(
            {
                "stage": engine.stage_index,
                "layers": [stage.layers.start, stage.layers.end],
                "first": bool(stage.is_first),
                "last": bool(stage.is_last),
                "decode_ms": 1000.0 * low,
                "decode_median_ms": 1000.0 * statistics.median(decode),
                "prefill_ms": 1000.0 * min(prefill),
                "context": context,
                "chunk": chunk,
            }
        )
    return results


def profile(
    shard_dir: Path,
    stages: list[int] | None = None,
    device: str = "CPU",
    threads: int = 0,
    inference_precision: str | None = None,
    kv_cache_precision: str | None = None,
    context: int = 128,
    tokens: int = 48,
    chunk: int = 128,
) -> dict[str, Any]:
    """Time the requested stages of SHARD_DIR (all by default), interleaved, with a worker's settings."""
    from remote_worker.engine import StageEngine
    from remote_worker.manifest import load_manifest

    manifest = load_manifest(shard_dir)
    indices = list(range(len(manifest.stages))) if stages is None else stages
    engines = [
        StageEngine(
            shard_dir, index, device, threads, inference_precision, kv_cache_precision, verify_hashes=False
        )
        for index in indices
    ]
    return {
        "model": manifest.model_name,
        "synthetic": manifest.synthetic,
        "num_layers": manifest.num_layers,
        "precision": manifest.precision,
        "device": device,
        "threads": threads,
        "cores": sorted(os.sched_getaffinity(0)),
        "properties": engines[0].effective_properties() if engines else {},
        "stages": time_stages(engines, context, tokens, chunk),
    }


def _list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m remote_worker.profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shard", type=Path, required=True, help="compiled shard directory")
    parser.add_argument("--stages", type=_list, help="stage indices to time (default: all)")
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--threads", type=int, default=0, help="inference threads (0 = plugin default)")
    parser.add_argument("--cores", type=_list, default=[], help="pin to these CPU cores first")
    parser.add_argument("--inference-precision", choices=("f32", "f16", "bf16"))
    parser.add_argument("--kv-cache-precision", choices=("f32", "f16", "u8"))
    parser.add_argument(
        "--context", type=int, default=128, help="cached tokens before the timed decode steps"
    )
    parser.add_argument("--tokens", type=int, default=48, help="timed decode steps")
    parser.add_argument("--chunk", type=int, default=128, help="tokens of the timed prefill chunk")
    arguments = parser.parse_args(argv)
    try:
        if arguments.cores:
            os.sched_setaffinity(0, arguments.cores)
        result = profile(
            arguments.shard,
            arguments.stages,
            arguments.device,
            arguments.threads,
            arguments.inference_precision,
            arguments.kv_cache_precision,
            arguments.context,
            arguments.tokens,
            arguments.chunk,
        )
    except Exception as error:  # one line for the caller (fleettui plan --profile shows it)
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"profile: {message}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
