"""Provides the calibration run of compiled shards: what a stage really costs per decoded token and
per prefill chunk.

    python -m remote_worker.profile --shard DIR [--stages 0,1,2] [--device CPU] [--threads T]
        [--cores 0] [--inference-precision f32] [--kv-cache-precision f32] [--context 128]
        [--tokens 24] [--chunk 128]
        [--pipeline S | --pauses-ms P0,P1,...] [--until-stdin-closes]

Prints one JSON object: per stage, its layers, whether it holds the embedding / the head, and the
milliseconds of a 1-token decode step after CONTEXT cached tokens (the lowest 20th percentile of 4
windows 0.5 s apart), each step after the pause the stage has live (`time_stages`), and of one
CHUNK-token prefill (the fastest of 4). Inputs are random (ids or hidden states): cost does not
depend on the values. The stages run in this process exactly as a worker runs them (same
StageEngine, same OpenVINO settings)."""

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


WINDOWS = 4  # timing windows per calibration, GAP seconds apart
GAP = 0.5


class Clock:
    """The timing's clock and sleep: the process's own (tests give a simulated one)."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def time_stages(
    engines: list[Any],
    context: int = 128,
    tokens: int = 48,
    chunk: int = 128,
    windows: int = WINDOWS,
    gap: float = GAP,
    pauses_ms: list[float] | None = None,
    pipeline: int = 0,
    clock: Clock | None = None,
) -> list[dict[str, Any]]:
    """Per engine: 1-token decode ms after CONTEXT tokens and the ms of a CHUNK prefill, at their
    quietest.

    A step costs more after a pause (docs/performance.md#tuning-constants), and a stage in a
    pipeline serving one user pauses while the rest of the pipeline computes its token, so each
    engine's steps are timed after the pause it will have live: PAUSES_MS[i] before each of engine
    i's steps when given (the rest of a planned split, predicted), else (PIPELINE-1)/ PIPELINE of
    the whole model's token, measured on these engines, which must then make up the model (the
    calibration split; PIPELINE <= 1: back to back). Stepping the calibration stages round-robin
    instead would give each stage a pause unlike its live one and misjudge the head.

    Every engine is timed in the same windows, one block of steps each, so load from other programs
    slows them alike and does not skew one stage against another. The TOKENS steps are spread over
    WINDOWS windows GAP seconds apart, and a stage's cost is the lowest of its windows' low
    percentiles (20th), its prefill the fastest of one per window: other programs only ever make a
    step slower, and a host timed beside another (each on its own cores) must not come out slower
    for a half-second burst on its core alone, which would skew the split."""
    clock = clock or Clock()
    generator = np.random.default_rng(0)
    per_window = max(1, -(-tokens // windows))
    for engine in engines:
        engine.open(1)
    try:
        if pauses_ms is not None:
            pauses = [max(0.0, float(pause)) / 1000.0 for pause in pauses_ms]
        elif pipeline > 1:  # an untimed estimate of the whole model's token after such a pause
            share = (pipeline - 1) / pipeline
            back_to_back = _window(engines, [0.0] * len(engines), 4, context, generator, clock)
            rough = [share * sum(statistics.median(t) for t in back_to_back)] * len(engines)
            paused = _window(engines, rough, per_window, context, generator, clock)
            pauses = [share * sum(statistics.median(t) for t in paused)] * len(engines)
        else:
            pauses = [0.0] * len(engines)
        decode: list[list[list[float]]] = [[] for _ in engines]  # per engine, per window
        prefills: list[list[float]] = [[] for _ in engines]
        for window in range(windows):
            if window:
                clock.sleep(gap)
            for times, timed in zip(
                decode, _window(engines, pauses, per_window, context, generator, clock), strict=True
            ):
                times.append(timed)
            for engine, prefill in zip(engines, prefills, strict=True):
                engine.reset(1)
                data = _inputs(engine, chunk, generator)
                started = clock.now()
                engine.step(1, 0, 0, NO_MASK, data, keep_last=1)
                prefill.append(clock.now() - started)
    finally:
        for engine in engines:
            engine.close(1)
    results = []
    for engine, steps, prefill, pause in zip(engines, decode, prefills, pauses, strict=True):
        stage = engine.stage
        lows = [float(np.percentile(window, 20)) for window in steps]
        results.append(
            {
                "stage": engine.stage_index,
                "layers": [stage.layers.start, stage.layers.end],
                "first": bool(stage.is_first),
                "last": bool(stage.is_last),
                "decode_ms": 1000.0 * min(lows),
                "decode_median_ms": 1000.0
                * statistics.median(t for window in steps for t in window),
                "decode_windows_ms": [1000.0 * low for low in lows],
                "pause_ms": 1000.0 * pause,
                "prefill_ms": 1000.0 * min(prefill),
                "context": context,
                "chunk": chunk,
            }
        )
    return results


def _window(
    engines: list[Any],
    pauses: list[float],
    steps: int,
    context: int,
    generator: np.random.Generator,
    clock: Clock,
) -> list[list[float]]:
    """One timing window: per engine, STEPS 1-token decode steps after CONTEXT cached tokens, each
    after that engine's pause (seconds); the two first steps after the prefill (which reallocate) go
    untimed."""
    found: list[list[float]] = []
    for engine, pause in zip(engines, pauses, strict=True):
        engine.reset(1)
        engine.step(1, 0, 0, NO_MASK, _inputs(engine, context, generator), keep_last=1)
        times: list[float] = []
        for index in range(steps + 2):
            position = context + index
            data = _inputs(engine, 1, generator)
            if pause:
                clock.sleep(pause)
            started = clock.now()
            engine.step(1, position, position, NO_MASK, data)
            if index >= 2:
                times.append(clock.now() - started)
        found.append(times)
    return found


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
    pauses_ms: list[float] | None = None,
    pipeline: int = 0,
) -> dict[str, Any]:
    """Time the requested stages of SHARD_DIR (all by default) in the same windows, with a
    worker's settings."""
    from remote_worker.engine import StageEngine
    from remote_worker.manifest import load_manifest

    manifest = load_manifest(shard_dir)
    indices = list(range(len(manifest.stages))) if stages is None else stages
    engines = [
        StageEngine(
            shard_dir,
            index,
            device,
            threads,
            inference_precision,
            kv_cache_precision,
            verify_hashes=False,
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
        "stages": time_stages(
            engines, context, tokens, chunk, pauses_ms=pauses_ms, pipeline=pipeline
        ),
    }


def _list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _pauses(text: str) -> list[float]:
    try:
        found = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of milliseconds"
        ) from None
    if any(not 0.0 <= pause <= 10_000.0 for pause in found):
        raise argparse.ArgumentTypeError(f"{text!r}: each pause must be within [0, 10000] ms")
    return found


def _exit_when_stdin_closes() -> None:
    """End this process when its standard input closes: run over SSH, a dropped or cancelled
    connection closes it, and a timing nobody waits for must not keep a remote core busy."""
    import threading

    def watch() -> None:
        while os.read(
            0, 4096
        ):  # the raw descriptor: a thread blocked in sys.stdin would hold its buffer's
            # lock, and the interpreter aborts at exit ("could not acquire lock ... at shutdown")
            pass
        try:  # (its stderr is closed too when the connection dropped)
            print("profile: standard input closed, stopping", file=sys.stderr, flush=True)
        finally:
            os._exit(130)

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m remote_worker.profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shard", type=Path, required=True, help="compiled shard directory")
    parser.add_argument("--stages", type=_list, help="stage indices to time (default: all)")
    parser.add_argument("--device", default="CPU")
    parser.add_argument(
        "--threads", type=int, default=0, help="inference threads (0 = plugin default)"
    )
    parser.add_argument("--cores", type=_list, default=[], help="pin to these CPU cores first")
    parser.add_argument("--inference-precision", choices=("f32", "f16", "bf16"))
    parser.add_argument("--kv-cache-precision", choices=("f32", "f16", "u8"))
    parser.add_argument(
        "--context", type=int, default=128, help="cached tokens before the timed decode steps"
    )
    parser.add_argument("--tokens", type=int, default=48, help="timed decode steps")
    parser.add_argument("--chunk", type=int, default=128, help="tokens of the timed prefill chunk")
    pause = parser.add_mutually_exclusive_group()
    pause.add_argument(
        "--pipeline",
        type=int,
        default=0,
        metavar="S",
        help="the stages make up the model: time each after (S-1)/S of its token, as in an S-stage "
        "pipeline",
    )
    pause.add_argument(
        "--pauses-ms", type=_pauses, help="per timed stage: its idle ms before each step"
    )
    parser.add_argument(
        "--until-stdin-closes",
        action="store_true",
        help="exit as soon as standard input closes (run over SSH: a dropped connection ends the "
        "timing)",
    )
    arguments = parser.parse_args(argv)
    if arguments.pauses_ms is not None and len(arguments.pauses_ms) != len(arguments.stages or ()):
        parser.error("--pauses-ms needs --stages and one pause per stage")
    if arguments.pipeline < 0:
        parser.error(f"--pipeline {arguments.pipeline}: a pipeline has at least 1 stage")
    if arguments.until_stdin_closes:
        _exit_when_stdin_closes()
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
            arguments.pauses_ms,
            arguments.pipeline,
        )
    except Exception as error:  # one line for the caller (fleettui plan --profile shows it)
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"profile: {message}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
