"""Provides the command line: python -m shard_compiler --model MODEL --stages N --precision P
[--out DIR]."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .compress import PRECISIONS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shard_compiler",
        description="Compile an LLM into per-stage OpenVINO pipeline shards.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="smollm2-135m-instruct, a Hugging Face folder or a .gguf file",
    )
    plan = parser.add_mutually_exclusive_group()
    plan.add_argument("--stages", type=int, help="number of stages (even split, default 1)")
    plan.add_argument(
        "--split",
        help="layer boundaries, e.g. 0,10,20,30; N.5 cuts layer N between its attention and MLP",
    )
    parser.add_argument(
        "--precision", default="int4", help=f"one of {', '.join(PRECISIONS)} (default int4)"
    )
    parser.add_argument(
        "--out", type=Path, help="output directory (default: the cache, keyed by content)"
    )
    parser.add_argument(
        "--cache-root",
        type=Path,
        help="cache root (default: the user cache folder, e.g. $XDG_CACHE_HOME/fleettui)",
    )
    parser.add_argument(
        "--force", action="store_true", help="recompile even if a valid cached result exists"
    )
    parser.add_argument("--no-beam-idx", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true", help="log details")
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if arguments.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from remote_worker.manifest import ManifestError, parse_boundary

    from . import CompileError, Progress, compile_shards
    from .synthetic import SyntheticError

    def show(event: Progress) -> None:
        where = "" if event.stage is None else f"stage {event.stage} "
        detail = f" ({event.message})" if event.message else ""
        print(
            f"[{event.fraction * 100:5.1f}%] {where}{event.step}{detail}",
            file=sys.stderr,
            flush=True,
        )

    try:
        split = (
            [parse_boundary(part) for part in arguments.split.split(",")] if arguments.split else []
        )
        directory = compile_shards(
            arguments.model,
            stages=[layer for layer, _ in split] if split else (arguments.stages or 1),
            precision=arguments.precision,
            out=arguments.out,
            progress=show,
            force=arguments.force,
            cache_root=arguments.cache_root,
            inject_beam_idx=not arguments.no_beam_idx,
            mid_cuts=[layer for layer, mid in split if mid],
        )
    except (CompileError, ManifestError, SyntheticError) as error:
        print(f"shard_compiler: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shard_compiler: interrupted", file=sys.stderr)
        return 130
    print(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
