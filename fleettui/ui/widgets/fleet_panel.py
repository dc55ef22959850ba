"""Provides the fleet panel: one table row per stage, redrawn from the `FleetMonitor` on a timer."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from fleettui.control.states import (
    Degraded,
    Failed,
    Idle,
    Loading,
    Lost,
    Provisioning,
    Ready,
    Recovering,
    Serving,
)
from fleettui.ui.formatting import truncate
from fleettui.ui.monitor import COLUMNS, FleetMonitor

STATE_WIDTH = 22
STATE_COLOURS: dict[type, str] = {  # lifecycle state → theme variable
    Idle: "foreground-muted",
    Provisioning: "warning",
    Loading: "warning",
    Ready: "success",
    Serving: "accent",
    Failed: "error",
    Lost: "error",
    Recovering: "warning",
    Degraded: "error",
}


class FleetPanel(DataTable[Text]):
    """The live fleet table. Call `redraw()` (cheap when nothing changed) from a timer."""

    def __init__(self, monitor: FleetMonitor, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id, cursor_type="row", zebra_stripes=True, show_cursor=False)
        self.monitor = monitor
        self._drawn_version = -1
        self.border_title = "fleet"

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)
        self.redraw()

    def redraw(self) -> None:
        if self._drawn_version == self.monitor.version:
            return
        self._drawn_version = self.monitor.version
        variables = self.app.theme_variables
        for name, view in self.monitor.stages.items():
            cells = view.cells()
            cells["state"] = truncate(cells["state"], STATE_WIDTH)
            colour = variables.get(STATE_COLOURS.get(type(view.state), "foreground"), "")
            row = {
                key: Text(value, style=colour if key == "state" else "")
                for key, value in cells.items()
            }
            if name in self.rows:
                for key, _ in COLUMNS:
                    self.update_cell(name, key, row[key], update_width=True)
            else:
                self.add_row(*(row[key] for key, _ in COLUMNS), key=name)
        self.border_subtitle = self._summary()

    def _summary(self) -> str:
        serving = self.monitor.serving()
        ready = sum(
            isinstance(view.state, (Ready, Serving)) for view in self.monitor.stages.values()
        )
        text = f"{ready}/{len(self.monitor.stages)} up"
        return text + (f" · serving: {', '.join(serving)}" if serving else "")
