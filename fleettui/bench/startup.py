"""Provides the startup measurement: each stage worker's start to ready, compile cache off and on.

`fleettui bench FLEET --startup [ROUNDS]` compiles (or finds) the fleet's shards, then for every
stage, in ROUNDS interleaved rounds, starts `python -m remote_worker` on a private folder of links
to the stage's files three times: with the compile cache off, on with an empty cache (the first
start after a deploy), and on again (a relaunch after a crash, a PC that rebooted: its compiled
model cached, its files' checks stamped, see `remote_worker.manifest.verify_files`). Each start is
timed from the process launch to its READY line and the worker's ping says how it got its compiled
model and how long its warm-up step took, so the report shows their shares too. Then, on a fleet of
local hosts, each round starts the whole fleet and asks two questions: the first answer's time to
first token against the next one's is what a user pays for a cold pipeline right after a deploy."""

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
from remote_worker.manifest import COMPILED_FOLDER, MANIFEST_NAME, VERIFIED_FOLDER

START_TIMEOUT = 600.0
MODES = ("off", "first", "again")  # cache off; on, empty; on, filled by the start before
FIRST_QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class Start:
    stage: int
    mode: str
    seconds: float  # launch to READY
    compile_seconds: float
    from_cache: bool
    warm_up_seconds: float = 0.0


@dataclass
class StartupReport:
    model: str
    split: list[tuple[int, int]]
    starts: list[Start] = field(default_factory=list)
    # (first, next) answer's TTFT, seconds
    answers: list[tuple[float, float]] = field(default_factory=list)

    def median(self, stage: int, mode: str, attribute: str = "seconds") -> float:
        values = [getattr(s, attribute) for s in self.starts if s.stage == stage and s.mode == mode]
        return statistics.median(values) if values else 0.0

    def summary(self) -> str:
        rounds = sum(1 for s in self.starts if s.stage == 0 and s.mode == "off")
        lines = [
            f"startup: {self.model}, split {self.split}, {rounds} interleaved round(s); launch to "
            "READY"
        ]
        for stage, layers in enumerate(self.split):
            cells = []
            for mode in MODES:
                cells.append(
                    f"{mode} {self.median(stage, mode):5.2f} s (compile "
                    f"{self.median(stage, mode, 'compile_seconds'):4.2f},"
                    f" warm-up {self.median(stage, mode, 'warm_up_seconds'):4.2f})"
                )
            off, again = self.median(stage, "off"), self.median(stage, "again")
            ratio = f"{again / off:.2f}x" if off else "-"
            cached = all(
                s.from_cache for s in self.starts if s.stage == stage and s.mode == "again"
            )
            lines.append(
                f"  stage {stage} {str(layers):<9} "
                + "  ".join(cells)
                + f"  again/off {ratio}{'' if cached else '  (not loaded from the cache!)'}"
            )
        if self.answers:
            first = statistics.median(a[0] for a in self.answers)
            following = statistics.median(a[1] for a in self.answers)
            lines.append(
                f"first answer after the fleet started ({len(self.answers)} round(s)): time to "
                "first token "
                f"{1000 * first:.0f} ms, the next answer's {1000 * following:.0f} ms "
                f"(first/next {first / following if following else 0:.2f}x)"
            )
        return "\n".join(lines)


async def startup_bench(
    fleet: Fleet, rounds: int = 3, on_line: Callable[[str], None] | None = None
) -> StartupReport:
    from fleettui.control.controller import FleetController, compile_model
    from fleettui.control.deployment import build_deployment

    say = on_line or (lambda line: None)
    plan = FleetController(fleet).layer_plan()
    ranges = list(plan.ranges)
    model = fleet.model
    compiled = await compile_model(
        model.name, ranges, model.precision, model.shards, say, plan.mid_cuts
    )
    report = StartupReport(fleet.model.name, ranges)
    deployed = build_deployment(fleet, ranges, lambda host: str(compiled.directory)).placements
    for stage in range(len(ranges)):
        with tempfile.TemporaryDirectory(prefix="fleettui-startup-") as work:
            folder = Path(work) / "shard"
            _link_tree(compiled.directory, folder, (MANIFEST_NAME, f"stage_{stage}"))
            for round_index in range(rounds):
                for mode in MODES:
                    if mode != "again":  # a start after a deploy: nothing compiled or checked yet
                        shutil.rmtree(folder / VERIFIED_FOLDER, ignore_errors=True)
                    if mode == "first":
                        shutil.rmtree(folder / COMPILED_FOLDER, ignore_errors=True)
                    start = await _start(deployed[stage].config, folder, stage, mode, Path(work))
                    report.starts.append(start)
                    say(
                        f"stage {stage} round {round_index + 1} {mode}: ready in "
                        f"{start.seconds:.2f} s "
                        f"(compile {start.compile_seconds:.2f} "
                        f"s{', from the cache' if start.from_cache else ''},"
                        f" warm-up {start.warm_up_seconds:.2f} s)"
                    )
    if all(host.is_local for host in fleet.hosts):
        for round_index in range(rounds):
            report.answers.append(await _first_answers(fleet))
            first, following = report.answers[-1]
            say(
                f"fleet round {round_index + 1}: first answer's first token {1000 * first:.0f} ms, "
                f"next {1000 * following:.0f} ms"
            )
    else:
        say(
            "first answers: not measured (the fleet has SSH hosts; this group starts local workers "
            "only)"
        )
    return report


async def _first_answers(fleet: Fleet) -> tuple[float, float]:
    """Start the fleet afresh (fresh ports, never attached nor recorded), ask twice; both answers'
    TTFT.

    The question goes in as token ids: the chat template's for a real model, seeded random ids for a
    synthetic one (no tokenizer)."""
    from fleettui.bench.runner import synthetic_prompts
    from fleettui.control.controller import FleetController
    from fleettui.control.deployment import free_port_block
    from fleettui.runtime.generation import GenerationParams

    hosts = tuple(replace(host, base_port=free_port_block()) for host in fleet.hosts)
    controller = FleetController(replace(fleet, hosts=hosts))
    params = GenerationParams(max_tokens=8)
    seconds = []
    try:
        coordinator = await controller.start(attach=False, record=False)
        chat = coordinator.chat_format
        assert controller.target is not None
        manifest = controller.target.manifest
        prompt = (
            chat.encode_question(FIRST_QUESTION)
            if chat is not None
            else synthetic_prompts(manifest.vocab_size, count=1)[0]
        )
        for _ in range(2):
            session = await controller.open_session()
            try:
                seconds.append((await controller.generate(session, prompt, params)).stats.ttft)
            finally:
                await controller.close_session(session)
    finally:
        await controller.stop()
    return seconds[0], seconds[1]


def _link_tree(source: Path, target: Path, names: tuple[str, ...]) -> None:
    """Hard links to NAMES under SOURCE (copies across file systems): the stage's files, none of
    its cache."""
    for name in names:
        for path in (
            [source / name] if (source / name).is_file() else sorted((source / name).rglob("*"))
        ):
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
    from fleettui.control.status import answer_seconds
    from fleettui.runtime.transport import control_request

    base = free_port_block()
    # as deployed (device, threads, precisions), alone: no links, plaintext, fresh ports
    config = replace(
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
        answer = (
            await control_request(f"tcp://127.0.0.1:{base + 1}", {"op": "ping"}, timeout=10.0) or {}
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 60)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
    return Start(
        stage,
        mode,
        seconds,
        answer_seconds(answer, "compile_seconds") or 0.0,
        answer.get("compiled_from_cache") is True,
        answer_seconds(answer, "warm_up_seconds") or 0.0,
    )
