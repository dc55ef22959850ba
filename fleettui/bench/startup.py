"""Provides the startup measurement: each stage worker's start to ready, compile cache off and on.

`fleettui bench FLEET --startup [ROUNDS]` compiles (or finds) the fleet's shards, then for every stage, in
ROUNDS interleaved rounds, starts `python -m remote_worker` on a private folder of links to the stage's files
three times: with the compile cache off, on with an empty cache (the first start after a deploy), and on again
(a relaunch after a crash, a PC that rebooted). Each start is timed from the process launch to its READY line
and the worker's ping says how it got its compiled model, so the report shows the compile's share too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from fleettui.config.fleet import Fleet
from remote_worker.config import StageConfig
from remote_worker.manifest import COMPILED_FOLDER, MANIFEST_NAME

START_TIMEOUT = 600.0
MODES = ("off", "first", "again")  # cache off; on, empty; on, filled by the start before


@dataclass(frozen=True)
class Start:
    stage: int
    mode: str
    seconds: float  # launch to READY
    compile_seconds: float
    from_cache: bool


@dataclass
class StartupReport:
    model: str
    split: list[tuple[int, int]]
    starts: list[Start] = field(default_factory=list)

    def median(self, stage: int, mode: str, attribute: str = "seconds") -> float:
        values = [getattr(s, attribute) for s in self.starts if s.stage == stage and s.mode == mode]
        return statistics.median(values) if values else 0.0

    def summary(self) -> str:
        rounds = sum(1 for s in self.starts if s.stage == 0 and s.mode == "off")
        lines = [f"startup: {self.model}, split {self.split}, {rounds} interleaved round(s); launch to READY"]
        for stage, layers in enumerate(self.split):
            cells = []
            for mode in MODES:
                cells.append(
                    f"{mode} {self.median(stage, mode):5.2f} s (compile {self.median(stage, mode, 'compile_seconds'):4.2f})"
                )
            off, again = self.median(stage, "off"), self.median(stage, "again")
            ratio = f"{again / off:.2f}x" if off else "-"
            cached = all(s.from_cache for s in self.starts if s.stage == stage and s.mode == "again")
            lines.append(
                f"  stage {stage} {str(layers):<9} "
                + "  ".join(cells)
                + f"  again/off {ratio}{'' if cached else '  (not loaded from the cache!)'}"
            )
        return "\n".join(lines)


async def startup_bench(
    fleet: Fleet, rounds: int = 3, on_line: Callable[[str], None] | None = None
) -> StartupReport:
    from fleettui.control.controller import FleetController, compile_model
    from fleettui.control.deployment import build_deployment

    say = on_line or (lambda line: None)
    ranges = FleetController(fleet).layer_ranges()
    compiled = await compile_model(fleet.model.name, ranges, fleet.model.precision, fleet.model.shards, say)
    report = StartupReport(fleet.model.name, ranges)
    deployed = build_deployment(fleet, ranges, lambda host: str(compiled.directory)).placements
    for stage in range(len(ranges)):
        with tempfile.TemporaryDirectory(prefix="fleettui-startup-") as work:
            folder = Path(work) / "shard"
            _link_tree(compiled.directory, folder, (MANIFEST_NAME, f"stage_{stage}"))
            for round_index in range(rounds):
                for mode in MODES:
                    if mode == "first":
                        shutil.rmtree(folder / COMPILED_FOLDER, ignore_errors=True)
                    start = await _start(deployed[stage].config, folder, stage, mode, Path(work))
                    report.starts.append(start)
                    say(
                        f"stage {stage} round {round_index + 1} {mode}: ready in {start.seconds:.2f} s "
                        f"(compile {start.compile_seconds:.2f} s{', from the cache' if start.from_cache else ''})"
                    )
    return report


def _link_tree(source: Path, target: Path, names: tuple[str, ...]) -> None:
    """Hard links to NAMES under SOURCE (copies across file systems): the stage's files, none of its cache."""
    for name in names:
        for path in [source / name] if (source / name).is_file() else sorted((source / name).rglob("*")):
            if path.is_dir():
                continue
            destination = target / path.relative_to(source)
            destination.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, destination)
            except OSError:
                shutil.copy2(path, destination)


async def _start(deployed: StageConfig, folder: Path, stage: int, mode: str, work: Path) -> Start:
    from fleettui.control.deployment import free_port_block
    from fleettui.runtime.transport import control_request

    base = free_port_block()
    config = replace(  # as deployed (device, threads, precisions), alone: no links, plaintext, fresh ports
        deployed,
        name=f"startup-{stage}",
        shard_dir=str(folder),
        data_port=base,
        control_port=base + 1,
        telemetry_port=base + 2,
        result_port=base + 3,
        bind_address="127.0.0.1",
        next=None,
        loop=None,
        curve=None,
        cpu_cores=(),
        compile_cache=mode != "off",
    )
    path = work / "stage.json"
    path.write_text(config.to_json())
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "remote_worker",
        "--config",
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT)
        seconds = time.perf_counter() - started
        if not line.startswith(b"READY"):
            raise RuntimeError(
                f"stage {stage}: the worker exited ({await process.wait()}) before it was ready"
            )
        answer = await control_request(f"tcp://127.0.0.1:{base + 1}", {"op": "ping"}, timeout=10.0) or {}
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 60)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
    compile_seconds = answer.get("compile_seconds")
    return Start(
        stage,
        mode,
        seconds,
        float(compile_seconds) if isinstance(compile_seconds, (int, float)) else 0.0,
        answer.get("compiled_from_cache") is True,
    )
