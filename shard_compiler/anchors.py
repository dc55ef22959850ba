"""Provides the single-PC anchor: OpenVINO GenAI `LLMPipeline` on the very same 1-stage IR as the
fleet.

    python -m shard_compiler.anchors --shard DIR --prompt-ids 1,2,3 --tokens 128 \\
        [--threads T] [--cores 0]
        [--inference-precision bf16] [--kv-cache-precision u8] --json

GenAI wants one folder with openvino_model.xml, the tokenizer/detokenizer IRs and the config files;
the shard directory keeps the IR in stage_0/ and the rest in tokenizer/, so a folder of symlinks to
both is assembled. Prints one JSON object (tokens, seconds, ttft_s, tok_s, precision, backend) or,
when GenAI cannot run the IR, {"skipped": "<exact reason>"} (exit code 0)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from remote_worker.manifest import load_manifest

GENAI_FILES = (
    "openvino_tokenizer.xml",
    "openvino_tokenizer.bin",
    "openvino_detokenizer.xml",
    "openvino_detokenizer.bin",
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
)


def _list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shard_compiler.anchors", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--shard", type=Path, required=True, help="compiled shard directory with exactly one stage"
    )
    parser.add_argument(
        "--prompt-ids", type=_list, required=True, help="prompt token ids, comma-separated"
    )
    parser.add_argument(
        "--tokens", type=int, default=128, help="new tokens to generate (EOS is ignored)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="inference threads (0 = plugin default)"
    )
    parser.add_argument(
        "--cores", type=_list, default=[], help="pin the process to these CPU cores"
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
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    parser.add_argument(
        "--scratch",
        help="folder for the assembled model (default: the system temp dir); a caller that may "
        "kill this "
        "process passes one it removes itself",
    )
    return parser


def assemble(shard: Path, folder: Path) -> Path:
    """FOLDER with symlinks to the 1-stage IR and the tokenizer files, in the layout GenAI reads."""
    manifest = load_manifest(shard)
    if len(manifest.stages) != 1:
        raise ValueError(
            f"{shard} has {len(manifest.stages)} stages; GenAI needs the unsplit 1-stage shard"
        )
    ir = shard / manifest.stages[0].ir
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "openvino_model.xml").symlink_to(ir.resolve())
    (folder / "openvino_model.bin").symlink_to(ir.with_suffix(".bin").resolve())
    tokenizer = shard / manifest.tokenizer
    for name in GENAI_FILES:
        if (tokenizer / name).exists():
            (folder / name).symlink_to((tokenizer / name).resolve())
    return folder


def _properties(arguments: argparse.Namespace) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    if arguments.threads > 0:
        properties["INFERENCE_NUM_THREADS"] = arguments.threads
    if arguments.inference_precision:
        properties["INFERENCE_PRECISION_HINT"] = arguments.inference_precision
    if arguments.kv_cache_precision:
        properties["KV_CACHE_PRECISION"] = arguments.kv_cache_precision
    return properties


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # OpenVINO errors start with a source location; the reason is usually the last meaningful line.
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:400]


def _pipeline(folder: Path, device: str, properties: dict[str, Any]) -> tuple[Any, str]:
    """The pipeline on the stateful SDPA backend, else on GenAI's default; returns (pipe, backend).

    SDPA first: the shards are stateful with batch fixed at 1, which the default PagedAttention
    backend (continuous batching, flattened token dimension) cannot run ("Can not clone with new
    dims")."""
    import openvino_genai

    try:
        return openvino_genai.LLMPipeline(
            str(folder), device, ATTENTION_BACKEND="SDPA", **properties
        ), "SDPA"
    except RuntimeError as first:
        try:
            return openvino_genai.LLMPipeline(str(folder), device, **properties), "default"
        except RuntimeError as second:
            raise RuntimeError(
                f"SDPA backend: {_first_line(first)}; default backend: {_first_line(second)}"
            ) from None


def _generate(pipe: Any, prompt: list[int], tokens: int) -> tuple[list[int], Any, float]:
    import numpy as np
    import openvino as ov
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = tokens
    config.min_new_tokens = tokens
    config.ignore_eos = True
    config.do_sample = False
    ids = ov.Tensor(np.asarray([prompt], np.int64))
    mask = ov.Tensor(np.ones((1, len(prompt)), np.int64))
    started = time.perf_counter()
    result = pipe.generate(openvino_genai.TokenizedInputs(ids, mask), config)
    seconds = time.perf_counter() - started
    return [int(t) for t in result.tokens[0]], result.perf_metrics, seconds


def _effective(folder: Path, device: str, properties: dict[str, Any]) -> dict[str, str]:
    """What the plugin resolves these properties to (GenAI does not report it): a plain compile
    of the IR."""
    import openvino as ov

    try:
        compiled = ov.Core().compile_model(str(folder / "openvino_model.xml"), device, properties)
        return {
            key: str(compiled.get_property(key))
            for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION")
        }
    except RuntimeError:
        return {}


def run(arguments: argparse.Namespace) -> dict[str, Any]:
    import openvino
    import openvino_genai

    properties = _properties(arguments)
    with tempfile.TemporaryDirectory(prefix="fleettui-genai-", dir=arguments.scratch) as temporary:
        folder = assemble(arguments.shard, Path(temporary) / "model")
        try:
            pipe, backend = _pipeline(folder, arguments.device.upper(), properties)
        except RuntimeError as error:
            return {"skipped": f"GenAI LLMPipeline cannot load the IR: {error}"}
        try:
            if arguments.warmup > 0:
                _generate(pipe, arguments.prompt_ids, arguments.warmup)
            started_at = time.time()  # wall clock: the bench pairs rows measured at the same time
            produced, metrics, seconds = _generate(pipe, arguments.prompt_ids, arguments.tokens)
        except RuntimeError as error:
            return {"skipped": f"GenAI LLMPipeline cannot run the IR: {_first_line(error)}"}
        del pipe
        effective = _effective(folder, arguments.device.upper(), properties)
    manifest = load_manifest(arguments.shard)
    ttft = float(metrics.get_ttft().mean) / 1000.0
    return {
        "tokens": len(produced),
        "seconds": seconds,
        "started_at": started_at,
        "ttft_s": ttft,
        "tok_s": len(produced) / seconds if seconds > 0 else 0.0,
        "genai_throughput_tok_s": float(metrics.get_throughput().mean),
        "token_ids": produced,
        "prompt_tokens": len(arguments.prompt_ids),
        "precision": {
            "weights": manifest.precision,
            "inference": effective.get(
                "INFERENCE_PRECISION_HINT", arguments.inference_precision or "default"
            ),
            "kv_cache": effective.get(
                "KV_CACHE_PRECISION", arguments.kv_cache_precision or "default"
            ),
        },
        "backend": backend,
        "device": arguments.device.upper(),
        "threads": arguments.threads,
        "cores": sorted(os.sched_getaffinity(0)),
        "openvino": openvino.get_version(),
        "openvino_genai": openvino_genai.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    if arguments.tokens < 1:
        print("anchors: --tokens must be at least 1", file=sys.stderr)
        return 2
    if arguments.cores:
        try:
            os.sched_setaffinity(0, arguments.cores)
        except (OSError, ValueError) as error:
            print(f"anchors: --cores {arguments.cores}: {error}", file=sys.stderr)
            return 2
    try:
        result = run(arguments)
    except ImportError as error:
        result = {"skipped": f"openvino-genai is not installed ({error})"}
    except (OSError, ValueError) as error:
        print(f"anchors: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
