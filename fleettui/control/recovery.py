"""Provides the recovery of a running fleet: relaunch a lost stage, replay every session, or re-plan
without it.

The `Recovery` is given a started `FleetController`. Its `Watcher` declares a stage lost; the
recovery then pauses every session (the coordinator's `resume` event), fails the lost link's pending
requests at once, relaunches the worker on the same host (control/relaunch.py: local through the
`LocalLauncher`, SSH through the `SshLauncher`, which re-pushes only what changed; the deployment
record follows), rebuilds every open session's KV cache by replaying its token history, and lets the
sessions retry the round that was in flight. A host that does not come back within `grace_seconds`
is planned around: the remaining hosts get a new split (compiled on this machine with the usual
compile path), or the fleet is `Degraded` with the memory it lacks. Each step is timed in a
`RecoveryReport`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from fleettui.config.fleet import Fleet, ResilienceSettings
from fleettui.config.local_cores import share_local_cores
from fleettui.control import relaunch
from fleettui.control.compile import CompiledModel
from fleettui.control.deployment import Deployment, Placement, build_deployment
from fleettui.control.owner import FleetOwner
from fleettui.control.rebalance import Rebalancer, head_layers, moved_layers
from fleettui.control.states import (
    Degraded,
    LogLine,
    Lost,
    Ready,
    Recovering,
    RecoveryReport,
)
from fleettui.runtime.transport import StageLost
from fleettui.runtime.watch import Target, Watcher, WatchSettings
from remote_worker.replies import TelemetrySample

log = logging.getLogger(__name__)
RETRY_SECONDS = 1.0


class HostGone(RuntimeError):
    """A host whose worker could not be relaunched within the grace period."""


class Recovery:
    """Watches a started controller's workers and recovers from the loss of any of them."""

    def __init__(
        self,
        controller: FleetOwner,
        compile_model: Callable[..., Awaitable[CompiledModel]],
        settings: ResilienceSettings | None = None,
    ) -> None:
        """`controller` is a started `FleetController`; `compile_model` its compile path (for
        re-plans)."""
        self.controller = controller
        self.compile_model = compile_model
        self.settings = settings or controller.fleet.resilience
        assert controller.deployment is not None and controller.coordinator is not None
        self.watcher = Watcher(
            controller.deployment.keys,
            WatchSettings(self.settings.heartbeat_seconds, self.settings.detect_seconds),
            self._on_lost,
            self._on_reply,
        )
        self.reports: list[RecoveryReport] = []
        self.replies: dict[str, dict[str, Any]] = {}
        self._lost: dict[
            str, tuple[str, float]
        ] = {}  # name -> (reason, seconds silent when declared)
        self._task: asyncio.Task[None] | None = None
        self._exclusive = asyncio.Lock()  # one recovery or split switch at a time
        self.rebalancer: Rebalancer | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        self.python = sys.executable  # the interpreter local workers are relaunched with
        self.away: list[
            str
        ] = []  # hosts a re-plan left out, tried every `rejoin_seconds` (`_watch_away`)
        self.down: list[
            str
        ] = []  # stages of a degraded fleet whose hosts are gone: relaunched when back
        self._rejoining: asyncio.Task[None] | None = None

    # -- watching
    # -----------------------------------------------------------------------------------
    def start(self) -> None:
        controller = self.controller
        assert controller.deployment is not None and controller.coordinator is not None
        for placement in controller.deployment.placements:
            self._watch(placement)
        stages = controller.deployment.stages
        self.rebalancer = Rebalancer(
            controller.deployment.ranges(),
            [p.config.name for p in stages],
            self.settings.rebalance,
            self.settings.throttle_ratio,
            head_layers(controller.fleet),
            controller.emit,
            self.switch_split,
            moved=moved_layers(controller.target.manifest, controller.fleet)
            if controller.target
            else (),
        )
        controller.coordinator.result_observers.append(self.rebalancer.observe)

    def observe_sample(self, sample: TelemetrySample) -> None:
        """A telemetry sample (temperature) for the throttle check."""
        if self.rebalancer is not None:
            self.rebalancer.observe_sample(sample)

    def _watch(self, placement: Placement) -> None:
        name, controller = placement.config.name, self.controller
        status = lambda: relaunch.process_status(controller, placement)  # noqa: E731
        self.watcher.watch(Target(name, placement.control_url, placement.server_key, status))

    def _on_reply(self, name: str, reply: dict[str, Any]) -> None:
        self.replies[name] = reply

    def _hold(self, action: str) -> None:
        """A degraded fleet that may be whole again (its hosts are tried every `rejoin_seconds`):
        answers wait."""
        coordinator, seconds = self.controller.coordinator, self.settings.hold_seconds
        if action == "degraded" and self.settings.rejoin_seconds > 0 and seconds > 0:
            assert coordinator is not None, "recovery runs on a connected fleet"
            coordinator.hold.begin(seconds)
            self.controller.emit(
                LogLine(
                    "recovery",
                    f"answers wait up to {seconds:g} s for {', '.join(self.down)} to be back",
                )
            )

    async def stop(self) -> None:
        coordinator = self.controller.coordinator
        if coordinator is not None:
            coordinator.hold.end()  # held answers end now, with the degraded line
        await self.watcher.stop()
        for task in (self._task, self._rejoining):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # stopping
                    await task

    # -- declaring a loss
    # ---------------------------------------------------------------------------
    def _on_lost(self, name: str, reason: str, silent: float) -> None:
        controller, coordinator = self.controller, self.controller.coordinator
        controller.set_state(name, Lost(reason))
        controller.emit(LogLine("recovery", f"{name} lost: {reason}"))
        self._lost[name] = (reason, silent)
        self.idle.clear()
        connection = controller.connection
        if coordinator is not None and connection is not None:
            coordinator.resume.clear()
            connection.block(StageLost(f"{name} lost: {reason}"), draft=name == "draft")
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._recover(), name="recovery")

    # -- recovering
    # ---------------------------------------------------------------------------------
    async def _recover(self) -> None:
        coordinator = self.controller.coordinator
        assert coordinator is not None
        async with self._exclusive:
            await self._recover_locked()

    async def _recover_locked(self) -> None:
        coordinator = self.controller.coordinator
        assert coordinator is not None
        try:
            while self._lost:
                report = await self._recover_all()
                self._publish(report)
                if report.action in ("degraded", "failed"):
                    coordinator.fatal = report.message
                    self._hold(report.action)
                    break
        except Exception as error:  # recovery itself broke: every session gets this one clear line
            log.exception("recovery failed")
            coordinator.fatal = f"recovery failed: {error}"
        finally:
            coordinator.resume.set()
            self.idle.set()
        watching = self._rejoining is not None and not self._rejoining.done()
        if (self.away or self.down) and self.settings.rejoin_seconds > 0 and not watching:
            self._rejoining = asyncio.get_running_loop().create_task(
                self._watch_away(), name="rejoin"
            )

    async def _recover_all(self) -> RecoveryReport:
        """Relaunch (or plan around) everything lost, then replay; losses during either join this
        recovery."""
        coordinator = self.controller.coordinator
        assert coordinator is not None
        batch: dict[str, tuple[str, float]] = {}
        started = time.monotonic()
        action, messages, gone_all = "relaunch", [], []
        relaunch = replay = 0.0
        tokens = 0
        while self._lost:
            new, self._lost = dict(self._lost), {}
            batch.update(new)
            lost_now = sorted(new)
            gone: list[str] = []
            outcomes = await asyncio.gather(
                *(self._relaunch(name) for name in lost_now), return_exceptions=True
            )
            for name, outcome in zip(lost_now, outcomes, strict=True):
                if isinstance(outcome, HostGone):
                    gone.append(name)
                elif isinstance(outcome, BaseException):
                    raise outcome
            if "draft" in gone:  # the draft runs beside the coordinator; without it, decode plainly
                gone.remove("draft")
                coordinator.drafter, coordinator.max_k = None, 0
                coordinator.policy.fixed_k = 0
                messages.append("draft lost for good: speculation off")
            if gone:
                gone_all.extend(gone)
                action, message = await self._replan(gone)
                if action == "replan":
                    self.away += [name for name in gone if name not in self.away]
                messages.append(message)
                if action == "degraded":
                    self.down += [name for name in gone if name not in self.down]
                    break
            relaunch = time.monotonic() - started
            if self._lost:
                continue  # lost another one meanwhile: bring it back before replaying
            connection = self.controller.connection
            assert connection is not None, "recovery runs on a connected fleet"
            connection.unblock()
            for name in batch:
                if name not in gone_all:
                    self.controller.set_state(name, Recovering("replay"))
            replay_started = time.monotonic()
            try:
                tokens += await coordinator.rebuild_all()
            except StageLost:
                # lost again while replaying: relaunch it, then replay what is still missing
                continue
            replay = time.monotonic() - replay_started
            for name in batch:
                if name not in gone_all:
                    self.controller.set_state(name, Ready())
        names = tuple(sorted(batch))
        return RecoveryReport(
            names,
            tuple(batch[name][0] for name in names),
            action,
            max(silent for _, silent in batch.values()),
            relaunch,
            replay,
            len(coordinator.sessions),
            tokens,
            "; ".join(messages),
        )

    async def _relaunch(self, name: str) -> None:
        """Start the lost worker again on its host, retrying until `grace_seconds`; HostGone
        after that."""
        deployment = self.controller.deployment
        assert deployment is not None
        placement = next(p for p in deployment.placements if p.config.name == name)
        self.controller.set_state(name, Recovering("relaunch"))
        deadline = time.monotonic() + self.settings.grace_seconds
        attempt = 0
        while True:
            attempt += 1
            try:
                if placement.host.is_local:
                    await relaunch.relaunch_local(self.controller, placement, self.python)
                else:
                    await relaunch.relaunch_remote(self.controller, placement)
                self._watch(placement)
                return
            except Exception as error:  # any failure to come back counts against the grace period
                self.controller.emit(
                    LogLine("recovery", f"{name}: relaunch attempt {attempt} failed: {error}")
                )
                if time.monotonic() + RETRY_SECONDS >= deadline:
                    raise HostGone(f"{name}: {error}") from None
                await asyncio.sleep(RETRY_SECONDS)

    # -- switching the split (rebalance)
    # -------------------------------------------------------------
    async def switch_split(
        self, ranges: list[tuple[int, int]], compiled: CompiledModel | None = None
    ) -> None:
        """Compile `ranges` while serving (unless given), then switch to it between rounds and
        replay."""
        controller, coordinator = self.controller, self.controller.coordinator
        assert coordinator is not None
        model = controller.fleet.model
        if compiled is None:
            compiled = await self.compile_model(model.name, ranges, model.precision, model.shards)
        if controller.coordinator is not coordinator:
            return  # the fleet stopped meanwhile

        def split_fleet() -> Fleet:  # the fleet as it is once the lock is held
            fleet: Fleet = controller.fleet
            hosts = tuple(replace(h, layers=r) for h, r in zip(fleet.hosts, ranges, strict=True))
            return replace(fleet, hosts=hosts, path=None)

        started, switched, tokens = await self._switch_between_rounds(split_fleet, ranges, compiled)
        names = tuple(h.name for h in controller.fleet.hosts)
        self._publish_switch(
            names, "rebalance", "rebalance", started, switched, tokens, f"split {ranges}"
        )

    async def _switch_between_rounds(
        self, fleet_of: Callable[[], Fleet], ranges: list[tuple[int, int]], compiled: CompiledModel
    ) -> tuple[float, float, int]:
        """Under the recovery lock, once every session's round in flight has finished: switch to
        `ranges` of `compiled` on `fleet_of()` and replay every session. (started, switched,
        replayed tokens)."""
        coordinator = self.controller.coordinator
        assert coordinator is not None
        async with self._exclusive:
            started = time.monotonic()
            coordinator.resume.clear()
            try:
                for session in list(coordinator.sessions.values()):
                    async with session.lock:  # the round in flight finishes: a safe point
                        pass
                await self._switch(fleet_of(), ranges, compiled)
                switched = time.monotonic()
                tokens = await coordinator.rebuild_all()
            finally:
                if not self._lost:  # a loss meanwhile: the recovery resumes the sessions when done
                    coordinator.resume.set()
        return started, switched, tokens

    def _publish_switch(
        self,
        names: tuple[str, ...],
        reason: str,
        action: str,
        started: float,
        switched: float,
        tokens: int,
        message: str,
    ) -> None:
        """Publish a switch made on purpose (no loss to detect): `started`..`switched` the switch
        itself, then the replay of `tokens` until now."""
        coordinator = self.controller.coordinator
        sessions = len(coordinator.sessions) if coordinator is not None else 0
        replay = time.monotonic() - switched
        self._publish(
            RecoveryReport(
                names,
                (reason,) * len(names),
                action,
                0.0,
                switched - started,
                replay,
                sessions,
                tokens,
                message,
            )
        )

    def _publish(self, report: RecoveryReport) -> None:
        """Keep a report, send it to the controller's observers and log its one line."""
        self.reports.append(report)
        self.controller.emit(report)
        self.controller.emit(LogLine("recovery", _describe(report)))

    # -- a host planned around comes back
    # ------------------------------------------------------------
    async def _watch_away(self) -> None:
        """Try the hosts a re-plan left out every `rejoin_seconds` (a PC that slept or rebooted);
        those back get the model moved onto them again, as the fleet file plans it with them."""
        written = {host.name: host for host in self.controller.base_fleet.hosts}
        while self.away or self.down:
            await asyncio.sleep(self.settings.rejoin_seconds)
            if (
                self.down
            ):  # a degraded fleet: every lost host must be back before it can serve again
                down = [written[name] for name in self.down if name in written]
                if all(await asyncio.gather(*(relaunch.host_back(host) for host in down))):
                    try:
                        await self.revive()
                    except (
                        Exception
                    ) as error:  # (still gone after all): stay degraded, try again later
                        log.warning("revive of %s failed: %s", ", ".join(self.down), error)
                continue
            away = [written[name] for name in self.away if name in written]
            answers = await asyncio.gather(*(relaunch.host_back(host) for host in away))
            back = [host.name for host, answer in zip(away, answers, strict=True) if answer]
            if back:
                try:
                    await self.rejoin(back)
                except (
                    Exception
                ) as error:  # (a compile or a launch failed): keep serving, try again later
                    log.warning("rejoin of %s failed: %s", ", ".join(back), error)
                    self.controller.emit(
                        LogLine("recovery", f"{', '.join(back)} back, rejoin failed: {error}")
                    )

    async def revive(self) -> None:
        """A degraded fleet whose lost hosts are all back: their stages are started again as they
        were, the degraded state ends (new requests are served again) and sessions still open are
        replayed."""
        controller, coordinator = self.controller, self.controller.coordinator
        assert coordinator is not None and controller.connection is not None
        started = time.monotonic()
        async with self._exclusive:
            await asyncio.gather(*(self._relaunch(name) for name in self.down))
            controller.connection.unblock()
            coordinator.fatal = None
            # held answers go on: each is replayed, then resumes where it stopped
            coordinator.hold.end()
            switched = time.monotonic()
            tokens = await coordinator.rebuild_all()
        names, self.down = tuple(self.down), []
        for name in names:
            controller.set_state(name, Ready())
        self._publish_switch(
            names, "back", "rejoin", started, switched, tokens, "the degraded fleet is whole again"
        )

    async def rejoin(self, back: list[str]) -> None:
        """Move the model onto the fleet's hosts again with BACK among them: planned, compiled while
        serving, then switched to between rounds (sessions paused and replayed, as a split
        switch)."""
        from fleettui.planning.planner import plan_fleet

        controller, coordinator = self.controller, self.controller.coordinator
        assert coordinator is not None
        fleet = controller.fleet
        present = {host.name for host in fleet.hosts} | set(back)
        hosts = tuple(
            replace(h, layers=None) for h in controller.base_fleet.hosts if h.name in present
        )
        bigger = share_local_cores(replace(fleet, hosts=hosts, path=None))
        plan = plan_fleet(bigger)
        ranges = [(stage.start, stage.end) for stage in plan.stages]
        model = fleet.model
        started = time.monotonic()
        compiled = await self.compile_model(
            model.name, ranges, model.precision, model.shards, None, plan.mid_cuts
        )
        if controller.coordinator is not coordinator:
            return  # the fleet stopped meanwhile
        _, switched, tokens = await self._switch_between_rounds(lambda: bigger, ranges, compiled)
        self.away = [name for name in self.away if name not in back]
        split = ", ".join(f"{s.host} {s.span}" for s in plan.stages)
        self._publish_switch(
            tuple(back),
            "back",
            "rejoin",
            started,
            switched,
            tokens,
            f"with {', '.join(back)}: {split}",
        )

    # -- re-planning without a host
    # -----------------------------------------------------------------
    async def _replan(self, gone: list[str]) -> tuple[str, str]:
        """Move the model onto the hosts that are left: ("replan", summary) or ("degraded", why)."""
        from fleettui.errors import PlanError
        from fleettui.planning.planner import plan_fleet

        controller, coordinator = self.controller, self.controller.coordinator
        assert coordinator is not None and controller.deployment is not None
        fleet = controller.fleet
        # before the CPUs were shared out
        written = {host.name: host for host in controller.base_fleet.hosts}
        rest = tuple(
            replace(written.get(host.name, host), layers=None)
            for host in fleet.hosts
            if host.name not in gone
        )
        # the local survivors share anew
        smaller = share_local_cores(replace(fleet, hosts=rest, path=None))
        try:
            if not rest:
                raise PlanError("no host is left")
            plan = plan_fleet(smaller)
        except PlanError as error:
            reason = f"degraded: {missing_memory(fleet, rest)}; without {', '.join(gone)}: {error}"
            for name in gone:
                controller.set_state(name, Degraded(reason))
            return "degraded", reason
        for name in gone:
            controller.set_state(name, Recovering("replan"))
        ranges = [(stage.start, stage.end) for stage in plan.stages]

        def progress(line: str) -> None:
            controller.emit(LogLine("shard_compiler", line))

        model = fleet.model
        clock = time.monotonic()
        compiled = await self.compile_model(
            model.name, ranges, model.precision, model.shards, progress, plan.mid_cuts
        )
        compile_seconds, clock = time.monotonic() - clock, time.monotonic()
        await self._switch(smaller, ranges, compiled)
        split = ", ".join(f"{s.host} {s.span}" for s in plan.stages)
        split += " by measured costs" if plan.costs is not None else " by parameter bytes"
        launch_seconds = time.monotonic() - clock
        return "replan", (
            f"without {', '.join(gone)}: {split} (compile {compile_seconds:.2f} s, launch "
            f"{launch_seconds:.2f} s)"
        )

    async def _switch(
        self, fleet: Fleet, ranges: list[tuple[int, int]], compiled: CompiledModel
    ) -> None:
        """Replace every stage worker by the split `ranges` of `compiled` on `fleet`'s hosts
        (sessions paused).

        The caller bumps nothing: the coordinator's target epoch moves on here, so every session
        replays."""
        controller, coordinator = self.controller, self.controller.coordinator
        assert coordinator is not None and controller.deployment is not None
        old = controller.deployment
        for placement in old.stages:  # the old split's survivors hold the wrong layers: they go
            self.watcher.forget(placement.config.name)
        deployment = _rekeyed(
            build_deployment(fleet, ranges, lambda host: str(compiled.directory)), old
        )
        controller.fleet, controller.target = fleet, compiled
        await relaunch.launch_split(controller, fleet, old, deployment)
        assert controller.connection is not None, "a switch runs on a connected fleet"
        await controller.connection.retarget(deployment)
        for placement in deployment.stages:
            controller.set_state(placement.config.name, Ready())
            self._watch(placement)
        if self.rebalancer is not None:
            names = [p.config.name for p in deployment.stages]
            self.rebalancer.reset(ranges, names, moved_layers(compiled.manifest, fleet))


def _rekeyed(deployment: Deployment, old: Deployment) -> Deployment:
    """The new split keeps the coordinator's key pair (its draft link stays valid) and the old
    draft."""
    if old.keys is None or deployment.keys is None:
        return replace(deployment, draft=old.draft, id=old.id)
    fresh, kept = deployment.keys.public_key, old.keys.public_key
    stages = []
    for placement in deployment.stages:
        curve = placement.config.curve
        assert curve is not None
        allowed = tuple(kept if key == fresh else key for key in curve.allowed_clients)
        config = replace(
            placement.config, curve=replace(curve, allowed_clients=allowed), deployment=old.id
        )
        stages.append(replace(placement, config=config))
    return replace(deployment, stages=tuple(stages), draft=old.draft, keys=old.keys, id=old.id)


def missing_memory(fleet: Fleet, rest: tuple[Any, ...]) -> str:
    """`needs N GB more`: what the full fleet's plan uses against what the remaining hosts offer."""
    from fleettui.errors import PlanError
    from fleettui.planning.planner import plan_fleet

    try:
        plan = plan_fleet(replace(fleet, path=None))
    except PlanError:
        return "the model does not fit"
    needed = sum(stage.total_bytes for stage in plan.stages) / 1e9
    offered = sum(host.memory_gb for host in rest) * 2**30 / 1e9
    return f"needs {max(0.1, needed - offered):.1f} GB more"


def _describe(report: RecoveryReport) -> str:
    what = ", ".join(
        f"{name} ({reason})" for name, reason in zip(report.stages, report.reasons, strict=True)
    )
    line = (
        f"{report.action} after losing {what}: detect {report.detect:.2f} s, relaunch "
        f"{report.relaunch:.2f} s, "
        f"replay {report.replay:.2f} s ({report.sessions} sessions, {report.replayed_tokens} "
        "tokens)"
    )
    return f"{line}; {report.message}" if report.message else line
