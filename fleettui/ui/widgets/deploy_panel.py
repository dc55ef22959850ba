"""Provides the deploy panel: per host the current step, a transfer bar with MB and MB/s, or the
failure."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Label, ProgressBar

from fleettui.control.states import Failed, Idle, Provisioning, Ready, Serving, StageState
from fleettui.ui.formatting import TransferRate, transfer_text, truncate

DETAIL_WIDTH = 60


class DeployRow(Horizontal):
    """One host (or the shard compiler): name, step, bar (only while bytes are counted) and detail.

    The row keeps what it shows as plain attributes and draws them in `_draw()`, so updates that
    arrive before its children are mounted are not lost.
    """

    def __init__(self, name: str) -> None:
        super().__init__(classes="deploy-row")
        self.host_name = name
        self.rate = TransferRate()
        self.step = "waiting"
        self.detail = ""
        self.done = 0.0
        self.total = 0.0
        self.failed = False

    def compose(self) -> ComposeResult:
        yield Label(self.host_name, classes="deploy-name")
        yield Label(self.step, classes="deploy-step")
        yield ProgressBar(show_eta=False, show_percentage=False, classes="deploy-bar")
        yield Label("", classes="deploy-detail")

    def on_mount(self) -> None:
        self._draw()

    def show_progress(self, step: str, done: float, total: float, text: str) -> None:
        if step != self.step:
            self.rate = TransferRate()
        self.step, self.done, self.total, self.failed = step, done, total, False
        if total > 0:
            self.rate.add(done)
            self.detail = transfer_text(done, total, self.rate.bytes_per_second)
        else:
            self.detail = text
        self._draw()

    def show_state(self, state: StageState) -> None:
        self.failed = isinstance(state, Failed)
        if isinstance(state, Failed):
            self.step, self.detail, self.total = "failed", state.reason, 0.0
        elif isinstance(state, (Ready, Serving)):
            self.step, self.detail, self.total = "ready", "", 0.0
        elif isinstance(state, Idle):
            self.step, self.detail, self.total = "idle", "", 0.0
        elif isinstance(state, Provisioning) and state.step:
            self.step = state.step
        else:
            self.step = state.label
        self._draw()

    def _draw(self) -> None:
        if not self.is_mounted:
            return
        self.set_class(self.failed, "failed")
        self.query_one(".deploy-step", Label).update(self.step)
        self.query_one(".deploy-detail", Label).update(truncate(self.detail, DETAIL_WIDTH))
        bar = self.query_one(ProgressBar)
        bar.display = self.total > 0
        if self.total > 0:
            bar.update(total=self.total, progress=min(self.done, self.total))


class DeployPanel(VerticalScroll):
    """Rows appear as hosts report; a failed host shows its one-line reason and the others keep
    going."""

    def __init__(self, names: list[str], *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self._rows = {name: DeployRow(name) for name in names}
        self.border_title = "deploy"

    def compose(self) -> ComposeResult:
        yield from self._rows.values()

    def row(self, name: str) -> DeployRow:
        if name not in self._rows:
            self._rows[name] = DeployRow(name)
            self.mount(self._rows[name])
        return self._rows[name]

    def forget(self, name: str) -> None:
        if name in self._rows:
            self._rows.pop(name).remove()

    def show_progress(self, name: str, step: str, done: float, total: float, text: str) -> None:
        self.row(name).show_progress(step, done, total, text)

    def show_state(self, name: str, state: StageState) -> None:
        self.row(name).show_state(state)
