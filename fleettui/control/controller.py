"""Provides the fleet controller: compile, deploy, hand-shake, chat and stop — the API any script or the TUI drives."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from fleettui.config.fleet import Fleet
from fleettui.control.deployment import Deployment, Placement, build_deployment
from fleettui.control.launcher import LocalLauncher
from fleettui.control.recovery import Recovery
from fleettui.control.states import (
    ControllerEvent,
    Failed,
    Idle,
    Loading,
    LogLine,
    Progress,
    Provisioning,
    Ready,
    StageChanged,
    StageState,
    Telemetry,
    next_state,
)  # fmt: skip
from fleettui.runtime.coordinator import Coordinator, Generation, GenerationParams
from fleettui.runtime.speculation import Drafter, ModelDrafter, PromptLookupDrafter
from fleettui.runtime.transport import TelemetryFeed, ZmqLink
from remote_worker import protocol
from remote_worker.config import Endpoint
from remote_worker.manifest import Manifest, load_manifest

log = logging.getLogger(__name__)


class ControllerError(RuntimeError):
    """The fleet could not be brought up; the message says which part and why."""


@dataclass(frozen=True)
class CompiledModel:
    directory: Path
    manifest: Manifest


def with_overrides(
    fleet: Fleet, exact: bool | None = None, draft: str | None = None, k: int | None = None
) -> Fleet:
    """The fleet with command-line overrides applied (`--exact`, `--no-spec`, `--spec-k`)."""
    if exact:
        runtime = replace(
            fleet.runtime, inference_precision="f32", kv_cache_precision="f32", wire_dtype="f32", exact=True
        )
        fleet = replace(fleet, runtime=runtime, model=replace(fleet.model, precision="fp32"))
    if draft is not None or k is not None:
        speculation = fleet.speculation
        if draft is not None:
            speculation = replace(speculation, draft=draft)
        if k is not None:
            speculation = replace(speculation, k=k, max_k=max(speculation.max_k, k))
        fleet = replace(fleet, speculation=speculation)
    return fleet


async def compile_model(
    model: str,
    ranges: list[tuple[int, int]],
    precision: str,
    cache_root: Path,
    on_progress: Callable[[str], None] | None = None,
) -> CompiledModel:
    """Run the shard compiler in a child process (it needs torch; the operator side must not import it)."""
    split = ",".join(str(bound) for bound in [ranges[0][0], *(end for _, end in ranges)])
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
    output = (await process.stdout.read()).decode(errors="replace").strip().splitlines()
    await progress_task
    if await process.wait() != 0 or not output:
        reason = errors[-1] if errors else f"exit code {process.returncode}"
        raise ControllerError(f"shard compiler: {reason}")
    last = output[-1]
    directory = Path(json.loads(last)["out"] if last.startswith("{") else last)
    return CompiledModel(directory, load_manifest(directory))


class FleetController:
    """Owns one running fleet: its shards, worker processes, links, coordinator and live stage states."""

    def __init__(
        self,
        fleet: Fleet,
        on_event: Callable[[ControllerEvent], None] | None = None,
        run_dir: Path | None = None,
    ) -> None:
        self.fleet = fleet
        self._on_event = on_event or (lambda event: None)
        self.run_dir = run_dir or Path(tempfile.mkdtemp(prefix="fleettui-run-"))
        self.launcher = LocalLauncher(self.run_dir)
        self.states: dict[str, StageState] = {host.name: Idle() for host in fleet.hosts}
        self.telemetry: dict[str, dict] = {}
        self.target: CompiledModel | None = None
        self.draft: CompiledModel | None = None
        self.deployment: Deployment | None = None
        self.coordinator: Coordinator | None = None
        self._links: list[ZmqLink] = []
        self.remote_report: object | None = None
        self.hops_ms: dict[str, float] = {}
        self._feed: TelemetryFeed | None = None
        self.recovery: Recovery | None = None  # resilience hook: watches workers, recovers lost stages

    # -- events -------------------------------------------------------------------------------------
    def _emit(self, event: ControllerEvent) -> None:
        try:
            self._on_event(event)
        except Exception:  # a broken observer must not take the fleet down
            log.exception("event observer failed")

    def _set_state(self, name: str, state: StageState) -> None:
        if self.states.get(name) != state:
            self.states[name] = state
            self._emit(StageChanged(name, state))

    def _observe_hops(self, result: protocol.Result, received: float) -> None:
        """Wire time from each stage to the next (the last stage: to the coordinator), smoothed, in ms."""
        trace = result.trace.reshape(-1, protocol.TRACE_FIELDS)
        if self.deployment is None or len(trace) != len(self.deployment.stages):
            return
        arrivals = [*trace[1:, 1], received]
        for (stage, _received, _started, _finished, sent), arrival in zip(trace, arrivals, strict=False):
            name = self.deployment.stages[int(stage)].config.name
            sample = (arrival - sent) * 1000.0
            previous = self.hops_ms.get(name)
            self.hops_ms[name] = sample if previous is None else 0.8 * previous + 0.2 * sample

    def _on_sample(self, sample: dict) -> None:
        name = str(sample.get("name", ""))
        if name in self.hops_ms:
            sample = {**sample, "hop_ms": round(self.hops_ms[name], 2)}
        self.telemetry[name] = sample
        if self.recovery is not None:  # resilience hook: temperatures for the throttle check
            self.recovery.observe_sample(sample)
        if name in self.states:
            self._set_state(name, next_state(self.states[name], sample))
        self._emit(Telemetry(name, sample))

    # -- lifecycle ----------------------------------------------------------------------------------
    def layer_ranges(self) -> list[tuple[int, int]]:
        from fleettui.planning.planner import plan_fleet

        return [tuple(r) for r in plan_fleet(self.fleet).ranges]  # type: ignore[misc]

    async def prepare(self) -> None:
        """Compile (or find in the cache) the target shards and the draft model."""
        for host in self.fleet.hosts:
            self._set_state(host.name, Provisioning("compile"))
        ranges = self.layer_ranges()
        model = self.fleet.model

        def progress(line: str) -> None:
            self._emit(LogLine("shard_compiler", line))
            self._emit(Progress("compiler", "compile", message=line))

        try:
            self.target = await compile_model(model.name, ranges, model.precision, model.shards, progress)
        except ControllerError as error:
            for host in self.fleet.hosts:
                self.fail(host.name, str(error))
            raise
        draft = self.fleet.speculation.draft
        if draft == "self-int4":
            num_layers = self.target.manifest.num_layers
            self.draft = await compile_model(model.name, [(0, num_layers)], "int4", model.shards, progress)
        elif draft not in ("none", "prompt-lookup"):
            path = Path(draft)
            if (path / "manifest.json").exists():
                self.draft = CompiledModel(path, load_manifest(path))
            else:
                self.draft = await compile_model(
                    draft, [(0, self._layers_of(path))], "int4", model.shards, progress
                )

    @staticmethod
    def _layers_of(path: Path) -> int:
        from fleettui.planning.shape import ModelShape

        return ModelShape.from_config_file(path / "config.json").num_layers

    async def start(
        self, ready_timeout: float = 600.0, endpoint_map: Callable[[Endpoint], Endpoint] | None = None
    ) -> Coordinator:
        """Prepare, launch every worker, wait for their handshakes and the chain's Hello; returns the coordinator.

        `endpoint_map` reroutes every data link of the chain (coordinator -> stage 0 -> ... -> coordinator),
        e.g. through the hop-delay proxies of `fleettui.bench.runner`; control and telemetry links stay direct.
        """
        if self.target is None:
            await self.prepare()
        assert self.target is not None
        ranges = [(s.layers.start, s.layers.end) for s in self.target.manifest.stages]
        target_dir = self.target.directory
        deployment = build_deployment(
            self.fleet,
            ranges,
            lambda host: str(target_dir),
            str(self.draft.directory) if self.draft else None,
        )
        if endpoint_map is not None:  # every stage's downstream link too, not only the coordinator's ends
            deployment = replace(
                deployment,
                stages=tuple(
                    replace(p, config=replace(p.config, next=endpoint_map(p.config.next)))
                    if p.config.next
                    else p
                    for p in deployment.stages
                ),
            )
        self.deployment = deployment
        workers = []
        for placement in deployment.placements:
            if placement.host.is_local:
                self._set_state(placement.config.name, Loading())
                workers.append(self.launcher.start(placement))
        remote = [p for p in deployment.stages if not p.host.is_local]
        waits = [self.launcher.wait_ready(w, deployment.keys, ready_timeout) for w in workers]
        results = await asyncio.gather(
            self._deploy_remote(remote, ready_timeout), *waits, return_exceptions=True
        )
        failures = []
        for worker, outcome in zip([None, *workers], results, strict=False):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome
                failures.append(str(outcome))
                if worker is not None:
                    self.fail(worker.placement.config.name, str(outcome))
            elif worker is not None:
                self._set_state(worker.placement.config.name, Ready())
                properties = json.dumps(outcome.get("properties", {}))  # type: ignore[union-attr]
                self._emit(LogLine(worker.placement.config.name, f"ready: {properties}"))
        if failures:
            await self.stop()
            raise ControllerError("; ".join(failures))
        head, tail = deployment.stages[0], deployment.stages[-1]
        route = endpoint_map or (lambda endpoint: endpoint)
        head_url = route(Endpoint(head.connect_address, head.config.data_port)).url()
        tail_url = route(Endpoint(tail.connect_address, tail.config.result_port)).url()  # type: ignore[arg-type]
        link = ZmqLink(head_url, tail_url, deployment.keys, head.server_key, tail.server_key)
        self._links.append(link)
        drafter = self._drafter(deployment)
        from fleettui.runtime.chat_format import ChatFormat

        chat_format = ChatFormat(self.target.directory, self.target.manifest)
        coordinator = Coordinator(link, chat_format, drafter, max_k=self.fleet.speculation.max_k)
        k = self.fleet.speculation.k
        if isinstance(k, int):
            coordinator.policy.fixed_k = k if drafter is not None else 0
        stages = await coordinator.hello()
        if stages != len(deployment.stages):
            raise ControllerError(f"handshake crossed {stages} stages, expected {len(deployment.stages)}")
        coordinator.result_observers.append(self._observe_hops)
        self.coordinator = coordinator
        urls = [(p.telemetry_url, p.server_key) for p in deployment.placements]
        self._feed = TelemetryFeed(urls, deployment.keys, self._on_sample)
        self._feed.start()
        self.recovery = Recovery(
            self, compile_model
        )  # resilience hook: heartbeats and recovery of lost stages
        self.recovery.start()
        return coordinator

    async def _deploy_remote(self, placements: list[Placement], ready_timeout: float) -> None:
        """Provision SSH hosts concurrently; raises when any stage could not be brought up."""
        if not placements:
            return
        from fleettui.provision.cli import deploy_placements, rest_can_run

        assert self.target is not None and self.deployment is not None
        remote = {p.host.name for p in placements}

        def on_event(event: object) -> None:
            name, step = event.host, event.step  # type: ignore[attr-defined]
            message = event.message  # type: ignore[attr-defined]
            self._emit(Progress(name, step, event.bytes_done, event.bytes_total, message))  # type: ignore[attr-defined]
            if message:
                self._emit(LogLine(name, f"{step}: {message}"))
            if name not in remote:
                return
            if step == "failed":
                self._set_state(name, Failed(message or "deploy failed"))
            elif step == "ready":
                self._set_state(name, Loading())
            elif step == "done":
                self._set_state(name, Ready())
            elif step != "skipped":
                self._set_state(name, Provisioning(step))

        report = await deploy_placements(
            self.fleet, self.deployment, self.target.directory, on_event, ready_timeout
        )
        self.remote_report = report
        if not report.ok:
            failed = {h.host for h in report.failed}
            lines = "; ".join(f"{h.host}: {h.step}: {h.error}" for h in report.failed)
            raise ControllerError(
                f"deploy failed on {len(failed)} host(s): {lines}. {rest_can_run(self.fleet, failed)}"
            )

    def _drafter(self, deployment: Deployment) -> Drafter | None:
        draft = self.fleet.speculation.draft
        if draft == "none":
            return None
        if draft == "prompt-lookup":
            return PromptLookupDrafter()
        assert deployment.draft is not None
        link = ZmqLink(
            deployment.draft.data_url,
            deployment.draft.result_url,
            deployment.keys,
            deployment.draft.server_key,
            deployment.draft.server_key,
        )
        self._links.append(link)
        return ModelDrafter(link, name=draft)

    async def ask(
        self,
        question: str,
        params: GenerationParams,
        on_tokens: Callable[[list[int], str], None] | None = None,
    ) -> Generation:
        """One prompt through the whole fleet in a fresh session."""
        coordinator = self.coordinator or await self.start()
        session = await coordinator.open_session(params.seed)
        try:
            return await coordinator.chat(session, question, params, on_tokens)
        finally:
            await coordinator.close_session(session)

    async def stop(self) -> list[str]:
        """Stop exactly the workers this controller started; returns what it did, one line each."""
        await self._release()
        keys = self.deployment.keys if self.deployment else None
        report = await self.launcher.stop(keys)
        if self.deployment is not None and any(not h.is_local for h in self.fleet.hosts):
            from fleettui.provision.deploy import stop_fleet

            stopped = await stop_fleet(self.fleet, self.deployment.id)
            report.extend(stopped.summary().splitlines())
        for name in self.states:
            if not isinstance(self.states[name], Failed):
                self._set_state(name, Idle())
        self.coordinator = None
        return report

    async def _release(self) -> None:
        """Close the telemetry feed and every link (the workers are not touched)."""
        if self.recovery is not None:  # resilience hook: stop watching before workers go away
            await self.recovery.stop()
            self.recovery = None
        if self._feed is not None:
            await self._feed.stop()
            self._feed = None
        for link in self._links:
            await link.close()
        self._links.clear()

    def fail(self, name: str, reason: str) -> None:
        self._set_state(name, Failed(reason))

    async def fetch_logs(self, lines: int = 20) -> dict[str, list[str]]:
        """The last lines of every worker's log: local files, and remote logs over SSH."""
        logs = {name: worker.log_tail(lines).split(" | ") for name, worker in self.launcher.workers.items()}
        remote = [host for host in self.fleet.hosts if not host.is_local]
        if remote:
            from fleettui.provision.deploy import fetch_log

            texts = await asyncio.gather(*(fetch_log(host) for host in remote), return_exceptions=True)
            for host, text in zip(remote, texts, strict=False):
                logs[host.name] = (
                    f"cannot fetch the log: {text}" if isinstance(text, BaseException) else str(text)
                ).splitlines()[-lines:]
        return logs

    async def detach(self) -> list[str]:
        """Leave every worker running and let go of them (`fleettui --stop` finds them by their pid files)."""
        await self._release()
        self.coordinator = None
        return self.launcher.detach()

    def kill(self) -> None:
        """Synchronous last resort (after a crash): kill every local worker this controller started."""
        self.launcher.kill_all()


def generation_params(
    fleet: Fleet,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    no_spec: bool = False,
    spec_k: int | None = None,
) -> GenerationParams:
    """Sampling settings from the fleet file, overridden by the command line."""
    sessions = fleet.sessions
    return GenerationParams(
        max_tokens=max_tokens or sessions.max_tokens,
        temperature=sessions.temperature if temperature is None else temperature,
        top_p=sessions.top_p if top_p is None else top_p,
        seed=sessions.seed if seed is None else seed,
        spec_k=0 if no_spec else spec_k,
    )
