"""Provides the shard compile step: the shard compiler runs in a child process (torch stays out
of fleettui)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fleettui.config.fleet import Fleet
from fleettui.errors import FleetError, child_failure
from remote_worker.manifest import Manifest, format_bounds, load_manifest

if TYPE_CHECKING:
    from fleettui.planning.planner import Plan


class CompileError(RuntimeError):
    """The shard compiler failed; the message is its last line."""


@dataclass(frozen=True)
class CompiledModel:
    directory: Path
    manifest: Manifest


async def compile_model(
    model: str,
    ranges: list[tuple[int, int]],
    precision: str,
    cache_root: Path,
    on_progress: Callable[[str], None] | None = None,
    mid_cuts: Collection[int] = (),
) -> CompiledModel:
    """Run the shard compiler in a child process (it needs torch; the operator side must not import
    it).

    A boundary in `mid_cuts` cuts the layer before it between its attention and its MLP."""
    split = ",".join(format_bounds([ranges[0][0], *(end for _, end in ranges)], mid_cuts))
    command = [
        sys.executable,
        "-m",
        "shard_compiler",
        "--model",
        model,
        "--split",
        split,
        "--precision",
        precision,
        "--cache-root",
        str(cache_root),
    ]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    errors: list[str] = []

    async def follow_progress(stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            if line:
                errors.append(line)
                if on_progress is not None:
                    on_progress(line)

    progress_task = asyncio.ensure_future(follow_progress(process.stderr))
    try:
        output = (await process.stdout.read()).decode(errors="replace").strip().splitlines()
        await progress_task
    except BaseException:  # cancelled (a signal): the compiler must not outlive the command
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise
    code = await process.wait()
    if code != 0 or not output:
        reason = child_failure("\n".join(errors), code)
        raise CompileError(f"shard compiler: {reason}")
    last = output[-1]
    directory = Path(json.loads(last)["out"] if last.startswith("{") else last)
    return CompiledModel(directory, load_manifest(directory))


async def compile_fleet(
    fleet: Fleet, plan: Plan, on_progress: Callable[[str], None] | None = None
) -> tuple[CompiledModel, CompiledModel | None]:
    """The target shards of the planned split and the draft model the fleet speculates with (None
    without one)."""
    from fleettui.control.model_package import ensure_model_package

    model = fleet.model
    ranges = list(plan.ranges)
    try:
        await ensure_model_package(model.name, on_progress)
    except FleetError as error:
        raise CompileError(str(error)) from None
    target = await compile_model(
        model.name, ranges, model.precision, model.shards, on_progress, plan.mid_cuts
    )
    draft = fleet.speculation.draft
    if draft in ("none", "prompt-lookup"):
        return target, None
    if draft == "self-int4":
        layers = [(0, target.manifest.num_layers)]
        return target, await compile_model(model.name, layers, "int4", model.shards, on_progress)
    path = Path(draft)
    if (path / "manifest.json").exists():
        return target, CompiledModel(path, load_manifest(path))
    from fleettui.model.shape import ModelShape

    layers = [(0, ModelShape.from_config_file(path / "config.json").num_layers)]
    return target, await compile_model(draft, layers, "int4", model.shards, on_progress)
