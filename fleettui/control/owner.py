"""Provides `FleetOwner`: what recovery and relaunching may use of the controller that owns them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet
    from fleettui.control.compile import CompiledModel
    from fleettui.control.connection import Connection
    from fleettui.control.deployment import Deployment
    from fleettui.control.launcher import Launched
    from fleettui.control.states import ControllerEvent, StageState
    from fleettui.control.store import DeploymentRecord
    from fleettui.runtime.coordinator import Coordinator


class FleetOwner(Protocol):
    """The controller as recovery sees it (`fleettui.control.controller.FleetController` is the
    one)."""

    base_fleet: Fleet  # as loaded from its file
    fleet: Fleet  # with the deployment's settings applied
    deployment: Deployment | None
    record: DeploymentRecord | None
    target: CompiledModel | None
    launched: list[Launched]

    @property
    def coordinator(self) -> Coordinator | None: ...

    @property
    def connection(self) -> Connection | None: ...

    @property
    def worker_lease(self) -> float: ...

    def emit(self, event: ControllerEvent) -> None: ...

    def set_state(self, name: str, state: StageState) -> None: ...
