"""Provides the fleet controller: the one path from a fleet file to running stages (plan, launch,
connect, serve).

`start()` attaches to the fleet's live recorded deployment, or calibrates hosts whose costs are
unknown, compiles, launches every stage (local and SSH behind one launcher interface), hand-shakes,
records the deployment and connects. A fleet started for one command holds its workers on a lease
the controller renews; `detach()` hands them to the record (`fleettui stop` finds them), `stop()`
stops this deployment's workers."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fleettui.config.fleet import Fleet
from fleettui.control import store
from fleettui.control.api import SessionHandle
from fleettui.control.calibration import calibrate_on_deploy
from fleettui.control.compile import CompiledModel, CompileError, compile_fleet, compile_model
from fleettui.control.connection import (
    Connection,
    Lease,
    answers_ping,
    connect,
    handshake,
    set_batching,
)
from fleettui.control.deployment import Deployment, Placement, build_deployment, rerouted
from fleettui.control.launcher import (
    Launched,
    LaunchError,
    LocalLauncher,
    SshLauncher,
    StageLauncher,
    check_ports,
    fetch_logs,
    kill_now,
    remove_folders,
    stop_local,
    stop_remote,
)
from fleettui.control.recovery import Recovery
from fleettui.control.settings import apply, generation_params, with_overrides
from fleettui.control.states import (
    ControllerEvent,
    Failed,
    Idle,
    Loading,
    LogLine,
    ModelInfo,
    Progress,
    Provisioning,
    Ready,
    StageChanged,
    StageState,
    Telemetry,
    next_state,
    provision_state,
)
from fleettui.control.store import DeploymentRecord, Settings
from fleettui.provision.events import ProvisionEvent, Step
from fleettui.runtime.chat_format import ChatMessage
from fleettui.runtime.coordinator import Coordinator
from fleettui.runtime.generation import Generation, GenerationParams, TokenCallback
from fleettui.runtime.session import Session
from remote_worker.config import Endpoint
from remote_worker.manifest import load_manifest
from remote_worker.replies import PingReply, TelemetrySample

if TYPE_CHECKING:
    from fleettui.planning.planner import Plan

__all__ = [
    "ControllerError",
    "FleetController",
    "compile_model",
    "generation_params",
    "with_overrides",
]

log = logging.getLogger(__name__)
# a worker started for one command exits this long after its controller vanished
LEASE_SECONDS = 30.0


class ControllerError(RuntimeError):
    """The fleet could not be brought up or attached; the message says which part and why."""


class FleetController:
    """Owns one fleet for one process: its deployment (launched or attached), links, coordinator
    and states."""

    def __init__(
        self,
        fleet: Fleet,
        on_event: Callable[[ControllerEvent], None] | None = None,
        settings: Settings | None = None,
        lease: float = LEASE_SECONDS,
        prune: bool = False,  # SSH hosts: remove their other shard folders once this one is pushed
        recheck: bool = False,  # read every stage file again, trusting no stamp of an earlier check
    ) -> None:
        self.settings = settings or Settings()
        self.prune, self.recheck = prune, recheck
        self.base_fleet, self.fleet = fleet, apply(fleet, self.settings)
        self._on_event = on_event or (lambda event: None)
        self.lease = lease
        self.states: dict[str, StageState] = {host.name: Idle() for host in fleet.hosts}
        self.samples: dict[str, TelemetrySample] = {}
        self.target: CompiledModel | None = None
        self.draft: CompiledModel | None = None
        self.deployment: Deployment | None = None
        self.record: DeploymentRecord | None = None
        self.attached = False  # True: serving a deployment another command launched
        self.launched: list[Launched] = []
        self.ready_replies: dict[str, PingReply] = {}
        self._connection: Connection | None = None
        self._lease: Lease | None = None
        self.recovery: Recovery | None = None  # watches the workers, recovers lost stages

    # -- events
    # -------------------------------------------------------------------------------------
    def emit(self, event: ControllerEvent) -> None:
        try:
            self._on_event(event)
        except Exception:  # a broken observer must not take the fleet down
            log.exception("event observer failed")

    def set_state(self, name: str, state: StageState) -> None:
        if self.states.get(name) != state:
            self.states[name] = state
            self.emit(StageChanged(name, state))

    def adopt(self, record: DeploymentRecord) -> None:
        """Take charge of a recorded deployment without attaching to it: to stop it or read its
        logs."""
        self.record = record
        self.deployment = record.deployment(self.base_fleet)

    def fail(self, name: str, reason: str) -> None:
        self.set_state(name, Failed(reason))

    def _on_sample(self, sample: TelemetrySample) -> None:
        name = sample.name
        self.samples[name] = sample
        if self.recovery is not None:  # temperatures for the throttle check
            self.recovery.observe_sample(sample)
        if name in self.states:
            self.set_state(name, next_state(self.states[name], sample))
        self.emit(Telemetry(name, sample))

    # -- what the UI and scripts read
    # ---------------------------------------------------------------
    @property
    def coordinator(self) -> Coordinator | None:
        return self._connection.coordinator if self._connection else None

    @property
    def connection(self) -> Connection | None:
        return self._connection

    def telemetry(self) -> Mapping[str, TelemetrySample]:
        return self.samples

    def worker_pids(self) -> dict[str, int]:
        """Local worker processes of the fleet (launched here or recorded by the one that
        launched them)."""
        if self.record is not None:
            return self.record.pids()
        return {
            each.placement.config.name: each.process.pid
            for each in self.launched
            if each.process is not None
        }

    @property
    def worker_lease(self) -> float:
        """The lease a worker started now runs on: this controller's while it renews one, else
        none."""
        return self.lease if self._lease is not None else 0.0

    def model_info(self) -> ModelInfo | None:
        return None if self.target is None else ModelInfo.of(self.fleet, self.target.manifest)

    def layer_ranges(self) -> list[tuple[float, float]]:
        """Each stage's layers as planned, for display: (0, 12.5) ends inside layer 12, after its
        attention."""
        return [stage.edges for stage in self.layer_plan().stages]

    def layer_plan(self) -> Plan:
        from fleettui.planning.planner import plan_fleet

        return plan_fleet(self.fleet)

    # -- lifecycle
    # ----------------------------------------------------------------------------------
    async def prepare(self) -> None:
        """Calibrate hosts whose costs are unknown (`control.calibration`), then compile the
        target and draft."""
        for host in self.fleet.hosts:
            self.set_state(host.name, Provisioning("compile"))

        def progress(line: str, source: str = "compiler", step: Step = "compile") -> None:
            self.emit(LogLine("shard_compiler" if source == "compiler" else source, line))
            self.emit(Progress(source, step, message=line))

        await calibrate_on_deploy(
            self.fleet, lambda line: progress(line, "calibration", "calibrate")
        )
        try:
            self.target, self.draft = await compile_fleet(self.fleet, self.layer_plan(), progress)
        except CompileError as error:
            for host in self.fleet.hosts:
                self.fail(host.name, str(error))
            raise ControllerError(str(error)) from None

    async def start(
        self,
        ready_timeout: float = 600.0,
        endpoint_map: Callable[[Endpoint], Endpoint] | None = None,
        *,
        attach: bool = True,
        record: bool = True,
    ) -> Coordinator:
        """Attach to the fleet's live deployment, or launch one; returns the connected coordinator.

        `endpoint_map` reroutes every data link of the chain (e.g. through the bench's hop-delay
        proxies); such a fleet is never attached to nor recorded."""
        if (
            self.coordinator is not None
        ):  # connected already (a failed stage is recovery's business)
            return self.coordinator
        if attach and endpoint_map is None and await self.attach():
            assert self.coordinator is not None
            return self.coordinator
        return await self._launch(ready_timeout, endpoint_map, record and endpoint_map is None)

    async def attach(self) -> bool:
        """Connect to the recorded deployment of this fleet file; False when none is alive (a
        stale one is cleared)."""
        found = store.load(self.base_fleet)
        if found is None:
            return False
        owner = store.busy_owner(found)
        if owner is not None:  # even a stale fleet is that process's to recover or stop
            raise ControllerError(
                f"{found.fleet_path} is in use by pid {owner.pid} (deployment {found.id}); "
                "wait for it, or `fleettui stop` the fleet"
            )
        reason = store.staleness(found, self.base_fleet)
        if reason is None:
            conflict = store.settings_conflict(self.settings, found)
            if conflict:
                raise ControllerError(conflict)
            deployment = found.deployment(apply(self.base_fleet, found.settings))
            replies = await asyncio.gather(
                *(answers_ping(p, deployment) for p in deployment.placements),
                return_exceptions=True,
            )
            silent = [
                p.config.name
                for p, r in zip(deployment.placements, replies, strict=True)
                if r is not True
            ]
            if silent:
                reason = f"deployment {found.id} is stale: {', '.join(silent)} does not answer"
        if reason is not None:
            self.emit(LogLine("fleet", f"{reason}; clearing it"))
            log.warning("%s; clearing it", reason)
            self.record = found
            for line in await self._stop_recorded(found):
                self.emit(LogLine("fleet", line))
            self.record = None
            return False
        self.settings = found.settings
        self.fleet = apply(self.base_fleet, found.settings)
        self.deployment = deployment
        self.target = CompiledModel(Path(found.target_dir), load_manifest(Path(found.target_dir)))
        self.record = store.held_by(found, os.getpid())
        store.save(self.record)
        self.attached = True
        self.emit(
            LogLine("fleet", f"attached to deployment {found.id} ({len(found.stages)} workers)")
        )
        for line in await Lease(
            lambda: deployment, 0.0
        ).end():  # handed over: no lease (nor a lost end's)
            self.emit(LogLine("fleet", line))
        await self._connect(deployment, None)
        return True

    async def _launch(
        self,
        ready_timeout: float,
        endpoint_map: Callable[[Endpoint], Endpoint] | None,
        record: bool,
    ) -> Coordinator:
        local_hosts = [host for host in self.fleet.hosts if host.is_local]
        try:
            check_ports(local_hosts)  # before anything is compiled or started
        except LaunchError as error:
            for host in local_hosts:
                self.fail(host.name, str(error))
            raise ControllerError(str(error)) from None
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
        if (
            endpoint_map is not None
        ):  # every stage's downstream link too, not only the coordinator's ends
            deployment = rerouted(deployment, endpoint_map)
        self.deployment = deployment
        if self.lease > 0:  # renewed from now on: a worker ready early waits for the others on it
            self._lease = Lease(lambda: self.deployment, self.lease)
            self._lease.start()
        local = [p for p in deployment.placements if p.host.is_local]
        local_launcher = LocalLauncher(
            deployment.keys, lease=self.worker_lease, recheck=self.recheck
        )
        for placement in local:
            self.set_state(placement.config.name, Loading())
            self.launched.append(await local_launcher.start(placement))
        if record and self.base_fleet.path is not None:
            self.record = self._record(deployment, owner=os.getpid())
            store.save(self.record)
        remote = SshLauncher(
            self.fleet,
            target_dir,
            deployment.keys,
            self._on_provision,
            ready_timeout,
            prune=self.prune,
            recheck=self.recheck,
            lease=self.worker_lease,
        )
        jobs = [self._bring_up(local_launcher, each, ready_timeout) for each in list(self.launched)]
        jobs += [self._bring_up_remote(remote, p) for p in deployment.stages if not p.host.is_local]
        outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        failures = [str(o) for o in outcomes if isinstance(o, Exception)]
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome
        if failures:
            if any(not p.host.is_local for p in deployment.stages):
                from fleettui.planning.planner import rest_can_run

                failed = {name for name, state in self.states.items() if isinstance(state, Failed)}
                failures.append(rest_can_run(self.fleet, failed))
            await self.stop()
            raise ControllerError("; ".join(failures))
        if self.record is not None:
            # SSH configs name the pushed shards
            self.record = self._record(deployment, owner=os.getpid())
            store.save(self.record)
        await self._connect(deployment, endpoint_map)
        assert self._connection is not None
        return self._connection.coordinator

    async def _bring_up(self, launcher: StageLauncher, launched: Launched, timeout: float) -> None:
        name = launched.placement.config.name
        try:
            reply = await launcher.handshake(launched, timeout)
        except LaunchError as error:
            self.fail(name, str(error))
            raise
        self.ready_replies[name] = reply
        self.set_state(name, Ready())
        self.emit(LogLine(name, f"ready (pid {reply.pid})"))

    async def _bring_up_remote(self, launcher: SshLauncher, placement: Placement) -> None:
        launched = await launcher.start(placement)
        self.launched.append(launched)
        self.ready_replies[placement.config.name] = await launcher.handshake(launched, 30.0)

    def _on_provision(self, event: ProvisionEvent) -> None:
        name, step, message = event.host, event.step, event.message
        self.emit(event)
        if message:
            self.emit(LogLine(name, f"{step}: {message}"))
        state = provision_state(step, message)
        if state is not None:
            self.set_state(name, state)

    def _record(self, deployment: Deployment, owner: int | None) -> DeploymentRecord:
        assert self.target is not None
        running = {
            each.placement.config.name: (each.placement.config, each.process)
            for each in self.launched
        }
        draft = str(self.draft.directory) if self.draft else None
        return store.record_of(
            self.base_fleet,
            self.settings,
            deployment,
            running,
            str(self.target.directory),
            draft,
            owner,
        )

    async def _connect(
        self, deployment: Deployment, endpoint_map: Callable[[Endpoint], Endpoint] | None
    ) -> None:
        assert self.target is not None
        try:
            self._connection = await connect(
                self.fleet, deployment, self.target, endpoint_map, self._on_sample
            )
            # heartbeats and recovery, the handshake's too
            self.recovery = Recovery(self, compile_model)
            self.recovery.start()
            await handshake(self._connection, self.recovery.idle.wait)
        except (RuntimeError, ValueError) as error:
            await self._release()
            raise ControllerError(f"connect: {error}") from None
        for placement in self._connection.deployment.stages:
            self.set_state(placement.config.name, Ready())

    async def _release(self) -> None:
        """Stop recovery and the lease watcher, close the telemetry feed and every link (workers
        untouched)."""
        if self.recovery is not None:  # stop watching before the workers go away
            await self.recovery.stop()
            self.recovery = None
        if self._lease is not None:
            await self._lease.cancel()
            self._lease = None
        if self._connection is not None:
            await self._connection.close()
            self._connection = None

    async def stop(self) -> list[str]:
        """Stop exactly this deployment's workers (launched here or recorded), forget its record
        and folders."""
        await self._release()
        report: list[str] = []
        if self.record is not None:
            report = await self._stop_recorded(self.record)
        elif self.deployment is not None:
            report = await self._stop_launched(self.deployment)
        self.launched.clear()
        self.record = None
        self.attached = False
        for name in self.states:
            if not isinstance(self.states[name], Failed):
                self.set_state(name, Idle())
        return report

    async def _stop_launched(self, deployment: Deployment) -> list[str]:
        jobs = []
        for each in self.launched:
            if each.placement.host.is_local:
                jobs.append(
                    stop_local(each.placement, each.process, deployment.keys, popen=each.popen)
                )
        jobs += [stop_remote(self.fleet, p) for p in deployment.stages if not p.host.is_local]
        report = [str(line) for line in await asyncio.gather(*jobs)]
        remove_folders(deployment.id)
        return report

    async def _stop_recorded(self, found: DeploymentRecord) -> list[str]:
        hosts = {host.name: host for host in self.base_fleet.hosts}
        popens = {each.placement.config.name: each.popen for each in self.launched}
        jobs = []
        for stage in found.stages:
            placement = stage.placement(hosts)
            if stage.local:
                jobs.append(
                    stop_local(placement, stage.process, found.keys, popen=popens.get(stage.name))
                )
            else:
                jobs.append(stop_remote(self.base_fleet, placement))
        report = [str(line) for line in await asyncio.gather(*jobs)]
        remove_folders(found.id)
        store.remove(found)
        return report

    async def detach(self) -> list[str]:
        """Leave every worker running for the record (lease off); `fleettui stop` or an attach
        finds them."""
        if self.deployment is None:
            return []
        lines = await self._lease.end() if self._lease is not None else []
        await self._release()
        if self.record is not None:
            self.record = (
                store.handed_over(self.record)
                if not self.attached
                else store.held_by(self.record, None)
            )
            path = store.save(self.record)
            lines.append(
                f"deployment {self.record.id} left running ({len(self.record.stages)} workers), "
                f"record {path}"
            )
        else:
            lines.append(f"deployment {self.deployment.id} left running, unrecorded")
        self.launched.clear()
        self.attached = False
        return lines

    async def deploy(self, ready_timeout: float = 600.0) -> list[str]:
        """Bring the fleet up (or find it up) and leave it running for later commands."""
        await self.start(ready_timeout)
        was_attached = self.attached
        lines = await self.detach()
        return ["already deployed", *lines] if was_attached else lines

    def kill(self) -> None:
        """Synchronous last resort (a crash, a second signal): kill every local worker this
        controller started."""
        kill_now(self.launched)
        if self.deployment is not None and self.launched:
            remove_folders(self.deployment.id)
        if self.record is not None and not self.attached:
            store.remove(self.record)
        self.launched.clear()

    # -- sessions
    # -----------------------------------------------------------------------------------
    def _coordinator(self) -> Coordinator:
        if self.coordinator is None:
            raise ControllerError("the fleet is not running")
        return self.coordinator

    async def open_session(self, seed: int = 0) -> Session:
        return await self._coordinator().open_session(seed)

    async def close_session(self, session: SessionHandle) -> None:
        assert isinstance(session, Session)
        await self._coordinator().close_session(session)

    async def chat(
        self,
        session: SessionHandle,
        text: str,
        params: GenerationParams,
        on_tokens: TokenCallback | None = None,
        raw: bool = False,
    ) -> Generation:
        # RAW: continue the session's text (a base model), no template
        assert isinstance(session, Session)
        return await self._coordinator().chat(session, text, params, on_tokens, raw)

    async def generate(
        self,
        session: Session,
        prompt: list[int],
        params: GenerationParams,
        on_tokens: TokenCallback | None = None,
    ) -> Generation:
        """A raw continuation of token ids (no chat template), for the HTTP API's completions."""
        return await self._coordinator().generate(session, prompt, params, on_tokens)

    async def ask(
        self,
        question: str,
        params: GenerationParams,
        on_tokens: TokenCallback | None = None,
        system: str | None = None,
        raw: bool = False,
    ) -> Generation:
        """One prompt through the whole fleet in a fresh session (after a system message; RAW: no
        template)."""
        if self.coordinator is None:
            await self.start()
        session = await self.open_session(params.seed)
        if system:
            session.messages.append(ChatMessage("system", system))
        try:
            return await self.chat(session, question, params, on_tokens, raw)
        finally:
            await self.close_session(session)

    async def set_batching(self, on: bool) -> None:
        """Run each stage's sessions as one inference (on) or one inference per session (off),
        e.g. for A/B."""
        if self.deployment is None:
            raise ControllerError("batching: no fleet is running")
        silent = await set_batching(self.deployment, on)
        if silent:
            raise ControllerError(f"batching: {', '.join(silent)} did not confirm the switch")

    async def fetch_logs(self, lines: int = 20) -> dict[str, list[str]]:
        """The last lines of every worker's log: local files, and remote logs over SSH."""
        if self.deployment is None:
            return {}
        return await fetch_logs(self.fleet, self.deployment, lines)
