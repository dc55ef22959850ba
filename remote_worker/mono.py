"""Provides the single-PC baseline: the unsplit 1-stage shard in one process, a plain greedy loop,
no sockets.

    python -m remote_worker.mono --shard DIR --prompt-ids 1,2,3 --tokens 128 \\
        [--threads T] [--cores 0]
        [--inference-precision bf16] [--kv-cache-precision u8] [--device CPU] [--wait-for-go] --json

Prints one JSON object: tokens, seconds, ttft_s, tok_s, the generated ids and the precision the
plugin actually used. A configuration this machine cannot run (device absent, a known plugin crash)
prints {"skipped": reason} and exits 0; `--probe` prints the OpenVINO version and devices and exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of token ids"
        ) from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError("at least one non-negative token id is needed")
    return ids


def _cores(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of CPU cores"
        ) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m remote_worker.mono", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--shard", type=Path, help="compiled shard directory with exactly one stage"
    )
    parser.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated")
    parser.add_argument(
        "--tokens", type=int, default=128, help="new tokens to generate (EOS is ignored)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="inference threads (0 = plugin default)"
    )
    parser.add_argument(
        "--cores", type=_cores, default=[], help="pin the process to these CPU cores"
    )
    parser.add_argument("--device", default="CPU", help="OpenVINO device")
    parser.add_argument(
        "--inference-precision", choices=("f32", "f16", "bf16"), help="default: the device's"
    )
    parser.add_argument(
        "--kv-cache-precision", choices=("f32", "f16", "u8"), help="default: the device's"
    )
    parser.add_argument(
        "--warmup", type=int, default=8, help="tokens of an untimed warm-up generation"
    )
    parser.add_argument(
        "--wait-for-go",
        action="store_true",
        help='after the warm-up print {"ready": true} and start only when a line arrives on stdin '
        "(several copies then decode at the same time)",
    )
    parser.add_argument(
        "--probe", action="store_true", help="print the OpenVINO version and devices, then exit"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    return parser


def probe() -> dict[str, object]:
    import openvino as ov

    core = ov.Core()
    devices = list(core.available_devices)
    names = {device: str(core.get_property(device, "FULL_DEVICE_NAME")) for device in devices}
    return {"openvino": ov.get_version(), "devices": devices, "device_names": names}


def greedy(
    engine: object, session: int, prompt: list[int], tokens: int
) -> tuple[list[int], float, float]:
    """Greedy decode `tokens` new ids after `prompt`; returns (ids, seconds, seconds to the first
    id)."""
    step = engine.step  # type: ignore[attr-defined]
    no_mask = np.zeros((0, 2), np.int64)
    started = time.perf_counter()
    logits = step(session, 0, 0, no_mask, np.asarray(prompt, np.int64), keep_last=1)
    produced = [int(np.argmax(logits[-1]))]
    ttft = time.perf_counter() - started
    position = len(prompt)
    while len(produced) < tokens:
        logits = step(session, position, position, no_mask, np.asarray(produced[-1:], np.int64))
        position += 1
        produced.append(int(np.argmax(logits[-1])))
    return produced, time.perf_counter() - started, ttft


def run(arguments: argparse.Namespace) -> dict[str, object]:
    from remote_worker.engine import EngineError, StageEngine

    found = probe()
    device = arguments.device.upper()
    if device.split(".")[0] not in {d.split(".")[0] for d in found["devices"]} and device != "AUTO":  # type: ignore[attr-defined]
        return {
            "skipped": f"device {device} is not available here "
            f"(devices: {', '.join(found['devices'])})"  # type: ignore[arg-type]
        }
    try:
        engine = StageEngine(
            arguments.shard,
            0,
            device,
            arguments.threads,
            arguments.inference_precision,
            arguments.kv_cache_precision,
        )
    except EngineError as error:
        return {"skipped": str(error)}
    if len(engine.manifest.stages) != 1:
        raise SystemExit(
            f"mono: {arguments.shard} has {len(engine.manifest.stages)} stages; the baseline needs "
            "1"
        )
    if arguments.warmup > 0:
        engine.open(0)
        greedy(engine, 0, arguments.prompt_ids, arguments.warmup)
        engine.close(0)
    engine.open(1)
    if arguments.wait_for_go:
        print(json.dumps({"ready": True}), flush=True)
        if not sys.stdin.readline():
            raise SystemExit("mono: stdin closed before the go")
    started_at = time.time()
    produced, seconds, ttft = greedy(engine, 1, arguments.prompt_ids, arguments.tokens)
    properties = engine.effective_properties()
    return {
        "tokens": len(produced),
        "seconds": seconds,
        "ttft_s": ttft,
        # wall clock: copies started together decode in overlapping windows
        "started_at": started_at,
        "tok_s": len(produced) / seconds if seconds > 0 else 0.0,
        "token_ids": produced,
        "prompt_tokens": len(arguments.prompt_ids),
        "precision": {
            "weights": engine.manifest.precision,
            "inference": properties.get("INFERENCE_PRECISION_HINT", "?"),
            "kv_cache": properties.get("KV_CACHE_PRECISION", "?"),
        },
        "properties": properties,
        "device": device,
        "threads": arguments.threads,
        "cores": sorted(os.sched_getaffinity(0)),
        "compile_seconds": engine.compile_seconds,
        "openvino": found["openvino"],
    }


def main(argv: list[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if arguments.cores:
        try:
            os.sched_setaffinity(0, arguments.cores)  # before OpenVINO starts its threads
        except (OSError, ValueError) as error:
            print(f"mono: --cores {arguments.cores}: {error}", file=sys.stderr)
            return 2
    try:
        if arguments.probe:
            result = probe()
        else:
            if arguments.shard is None or arguments.prompt_ids is None:
                print("mono: --shard and --prompt-ids are required", file=sys.stderr)
                return 2
            if arguments.tokens < 1:
                print("mono: --tokens must be at least 1", file=sys.stderr)
                return 2
            result = run(arguments)
    except Exception as error:  # one clear line, no traceback (the bench shows it in the row)
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"mono: {message}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
