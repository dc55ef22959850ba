"""Provides FleetApp, the one-screen TUI (deploy, monitor, chat, logs), and `run_app` for the
CLI."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input
from textual.worker import Worker, WorkerState

from fleettui.config.fleet import Fleet
from fleettui.control.api import ControlFactory, FleetControl
from fleettui.control.states import (
    ControllerEvent,
    Failed,
    LogLine,
    Progress,
    StageChanged,
    Telemetry,
    Throttled,
    next_step,
)
from fleettui.control.store import Settings
from fleettui.runtime.generation import GenerationParams
from fleettui.ui.api import ApiService
from fleettui.ui.formatting import stats_text, truncate
from fleettui.ui.messages import (
    DeployProgressed,
    LogWritten,
    PaneLogHandler,
    StageStateChanged,
    StageThrottled,
    TelemetrySampled,
)
from fleettui.ui.monitor import FleetMonitor, StageView
from fleettui.ui.screens.help import HelpScreen
from fleettui.ui.screens.quit import QuitChoice, QuitScreen
from fleettui.ui.widgets.api_panel import ApiPanel
from fleettui.ui.widgets.chat import ChatPane, ChatSession
from fleettui.ui.widgets.deploy_panel import DeployPanel
from fleettui.ui.widgets.fleet_panel import FleetPanel
from fleettui.ui.widgets.log_pane import LogPane

log = logging.getLogger(__name__)
DEPLOY_ROW = "fleet"  # the deploy panel's row for failures of the deploy as a whole
# the fleet table is redrawn at most twice a second, however fast telemetry comes
REDRAW_SECONDS = 0.5


def _session_keys() -> list[Binding]:
    keys = []
    for number in range(1, 10):
        keys.append(
            Binding(
                str(number),
                f"switch_session({number})",
                "switch to session N",
                show=False,
                key_display="1…9",
            )
        )
        keys.append(
            Binding(
                f"alt+{number}",
                f"switch_session({number})",
                "switch to session N (while typing)",
                show=False,
                priority=True,
                key_display="alt+1…9",
            )
        )
    return keys


class FleetApp(App[int]):
    """Deploys the fleet on mount, shows every stage live, and chats with several sessions at
    once."""

    CSS_PATH = "app.tcss"
    TITLE = "fleettui"
    BINDINGS = [
        Binding("d", "deploy", "deploy"),
        Binding("ctrl+n", "new_session", "new session", priority=True),
        Binding("n", "new_session", "new session", show=False),
        Binding("ctrl+tab,ctrl+pagedown", "cycle_session(1)", "next session", priority=True),
        Binding(
            "ctrl+shift+tab,ctrl+pageup",
            "cycle_session(-1)",
            "previous session",
            show=False,
            priority=True,
        ),
        *_session_keys(),
        Binding("i", "focus_prompt", "type a prompt", show=False),
        Binding("escape", "leave_prompt", "leave the prompt (then letter keys work)", show=False),
        Binding("l", "fetch_logs", "fetch logs"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("f1", "help", "help", priority=True),
        Binding("q", "request_quit", "quit"),
        Binding("ctrl+q", "request_quit", "quit", priority=True),
    ]

    def __init__(
        self,
        fleet: Fleet,
        controller_factory: ControlFactory,
        params: GenerationParams | None = None,
        auto_deploy: bool = True,
        api: ApiService | None = None,
        log_file: Path | None = None,
    ) -> None:
        super().__init__()
        self.fleet = fleet
        self.api = api  # the OpenAI-compatible API served beside the chat (`fleettui tui --serve`)
        # the log pane's persistent copy (run_app: paths.log_dir() / "tui.log")
        self.log_file = log_file
        if params is None:
            from fleettui.control.settings import generation_params

            # the fleet file's sampling, else the model's recommended
            params = generation_params(fleet)
        self.params = params
        self.controller = controller_factory(fleet, on_event=self.handle_controller_event)
        self.auto_deploy = auto_deploy
        self.ready = False  # the fleet answers (launched here or attached)
        self.monitor = FleetMonitor()
        self.quit_choice: QuitChoice | None = None
        self._log_handler = PaneLogHandler(self)
        # run_app: SIGHUP/SIGTERM stop the fleet (tests drive the app in-process)
        self.handle_signals = False
        self.detached_lines: list[str] = []
        self.sub_title = "idle"

    # -- layout
    # -------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        yield FleetPanel(self.monitor, id="fleet")
        with Horizontal(id="middle"):
            yield ChatPane(id="chat")
            with Vertical(id="side"):
                yield DeployPanel([host.name for host in self.fleet.hosts], id="deploy")
                if self.api is not None:
                    yield ApiPanel(id="api")
                yield LogPane(id="log", log_file=self.log_file)
        yield Footer()

    @property
    def chat(self) -> ChatPane:
        return self.query_one(ChatPane)

    def on_mount(self) -> None:
        logging.getLogger().addHandler(self._log_handler)
        if self.handle_signals:
            import asyncio
            import signal

            loop = asyncio.get_running_loop()
            for number in (signal.SIGHUP, signal.SIGTERM):
                loop.add_signal_handler(number, self.hang_up)
        ranges = self._layer_ranges()
        for index, host in enumerate(self.fleet.hosts):
            layers = ranges[index] if ranges and index < len(ranges) else None
            view = StageView(host.name, host.address, index, layers, host.device)
            view.state = self.controller.states.get(host.name, view.state)
            self.monitor.add(view)
        self.set_interval(REDRAW_SECONDS, self.redraw_fleet)
        self.query_one("#prompt", Input).focus()
        if self.auto_deploy:
            self.deploy()

    def on_unmount(self) -> None:
        logging.getLogger().removeHandler(self._log_handler)

    def _layer_ranges(self) -> list[tuple[float, float]] | None:
        try:
            return self.controller.layer_ranges()
        except (
            Exception
        ) as error:  # the plan is shown, not needed: a bad model file fails at deploy
            log.warning("no layer plan: %s", error)
            return None

    def redraw_fleet(self) -> None:
        for panel in self.query(FleetPanel):  # none while the app shuts down
            panel.redraw()
        if self.api is not None:
            for api_panel in self.query(ApiPanel):
                api_panel.show(*self.api.requests())

    # -- controller events (called by the controller, possibly from another thread)
    # -------------------
    def handle_controller_event(self, event: ControllerEvent) -> None:
        if isinstance(event, Telemetry):
            self.post_message(TelemetrySampled(event.name, event.sample))
        elif isinstance(event, StageChanged):
            self.post_message(StageStateChanged(event.name, event.state))
        elif isinstance(event, Progress):
            self.post_message(DeployProgressed(event))
        elif isinstance(event, LogLine):
            self.post_message(LogWritten(event.source, event.text))
        elif isinstance(event, Throttled):
            reason = f"{event.ratio:.1f}x its baseline" + (
                f", {event.reason}" if event.reason else ""
            )
            self.post_message(StageThrottled(event.name, reason if event.ratio > 1.0 else ""))

    def on_stage_throttled(self, message: StageThrottled) -> None:
        self.monitor.set_throttled(message.name, message.reason)

    def on_telemetry_sampled(self, message: TelemetrySampled) -> None:
        self.monitor.record(
            message.name, message.sample, known=message.name in self.controller.states
        )

    def on_stage_state_changed(self, message: StageStateChanged) -> None:
        self.monitor.set_state(message.name, message.state)
        for panel in self.query(DeployPanel):  # none while the app shuts down
            panel.show_state(message.name, message.state)
        if isinstance(message.state, Failed):
            log.error("%s failed: %s", message.name, message.state.reason)

    def on_deploy_progressed(self, message: DeployProgressed) -> None:
        for panel in self.query(DeployPanel):
            event = message.event
            panel.show_progress(
                event.host, event.step, event.bytes_done, event.bytes_total, event.message
            )

    def on_log_written(self, message: LogWritten) -> None:
        for pane in self.query(LogPane):  # none while the app shuts down
            pane.write_line(message.source, message.text, message.level)

    # -- workers
    # ------------------------------------------------------------------------------------
    @work(exclusive=True, group="fleet", exit_on_error=False, name="deploy")
    async def deploy(self) -> None:
        self.sub_title = "deploying…"
        for panel in self.query(DeployPanel):
            panel.forget(DEPLOY_ROW)
        await self.controller.start()
        self.ready = True
        info = self.controller.model_info()
        for pane in self.query(ChatPane):  # a base model (no chat template) continues text instead
            pane.set_completion_mode(info is not None and not info.chat_template)
        self.sub_title = "attached" if self.controller.attached else "ready"
        log.info(
            "fleet %s: %d stages",
            "attached" if self.controller.attached else "ready",
            len(self.fleet.hosts),
        )
        if self.api is not None:
            self.serve_api()

    @work(exclusive=True, group="api", exit_on_error=False, name="serve-api")
    async def serve_api(self) -> None:
        """The HTTP API on this app's loop, over the same fleet as the chat, until the fleet
        stops."""
        assert self.api is not None

        def ready(url: str) -> None:
            for panel in self.query(ApiPanel):
                panel.url = url
            log.info("serving the OpenAI-compatible API at %s", url)

        await self.api.run(self.controller, ready)

    async def _stop_api(self) -> None:
        if self.api is not None:
            await self.api.stop()

    @work(exclusive=True, group="fleet", exit_on_error=False, name="stop")
    async def stop_fleet(self, exit_after: bool = False) -> None:
        self.sub_title = "stopping…"
        for worker in self.workers:
            if worker.group.startswith("chat-"):
                worker.cancel()
        for pane in self.query(
            ChatPane
        ):  # the sessions die with the fleet; a redeploy opens new ones
            for session in pane.sessions:
                session.handle = None
        self.ready = False
        await self._stop_api()
        for line in await self.controller.stop():
            log.info("%s", line)
        self.sub_title = "stopped"
        if exit_after:
            self.exit(0)

    @work(exclusive=True, group="logs", exit_on_error=False, name="fetch-logs")
    async def fetch_logs(self) -> None:
        fetched = await self.controller.fetch_logs()
        for source, lines in fetched.items():
            for line in lines:
                self.post_message(LogWritten(source, line))

    async def _chat(self, session: ChatSession, text: str) -> None:
        """One reply in one session; several of these run at once (one worker group per session)."""
        session.busy = True
        self._draw_session_bar()
        try:
            reply = await session.begin_reply(text)
            if session.handle is None:
                session.handle = await self.controller.open_session(self.params.seed)

            async def on_tokens(_tokens: list[int], delta: str) -> None:
                await reply.write(delta)

            raw = any(pane.completion_mode for pane in self.query(ChatPane))
            generation = await self.controller.chat(
                session.handle, text, self.params, on_tokens, raw
            )
            stats = generation.stats
            await reply.finish(
                stats_text(
                    stats.tokens, stats.tokens_per_second, stats.acceptance_rate, stats.mean_k
                )
            )
        finally:
            session.busy = False
            self._draw_session_bar()

    def _draw_session_bar(self) -> None:
        for pane in self.query(ChatPane):  # none while the app shuts down
            pane.draw_bar()

    async def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """The one place background failures are handled."""
        worker, state = event.worker, event.state
        if state not in (WorkerState.ERROR, WorkerState.CANCELLED):
            return
        reason = truncate(str(worker.error) if worker.error else "cancelled", 200)
        if worker.group == "fleet":
            if (
                state == WorkerState.ERROR
            ):  # a cancelled deploy was replaced by a stop: nothing to report
                self.sub_title = f"{worker.name} failed"
                log.error("%s failed: %s", worker.name, reason)
                self.notify(reason, title=f"{worker.name} failed", severity="error")
                for panel in self.query(
                    DeployPanel
                ):  # the whole-fleet reason, next to the hosts' rows
                    panel.show_state(DEPLOY_ROW, Failed(reason))
        elif worker.group.startswith("chat-"):
            number = int(worker.group.removeprefix("chat-"))
            sessions = [s for pane in self.query(ChatPane) for s in pane.sessions]
            session = next((s for s in sessions if s.number == number), None)
            if session is not None and session.replies and not session.replies[-1].done:
                await session.replies[-1].finish(
                    f"failed: {reason}" if state == WorkerState.ERROR else "cancelled", failed=True
                )
            if state == WorkerState.ERROR:
                log.error("session %d: %s", number, reason)
        elif state == WorkerState.ERROR:
            log.error("%s failed: %s", worker.name, reason)

    # -- actions
    # ------------------------------------------------------------------------------------
    def on_chat_pane_prompt_submitted(self, message: ChatPane.PromptSubmitted) -> None:
        session = message.session
        if not self.ready:
            self.notify("The fleet is not ready yet (d deploys it).", severity="warning")
            return
        if session.busy:
            self.notify(
                f"Session {session.number} is still answering; ctrl+n opens another.",
                severity="warning",
            )
            return
        self.chat.clear_prompt()
        self.run_worker(
            self._chat(session, message.text),
            name=f"chat-{session.number}",
            group=f"chat-{session.number}",
            exclusive=True,
            exit_on_error=False,
        )

    def action_deploy(self) -> None:
        if self.ready and next_step(self.controller.states) in ("serve", "wait"):
            self.notify("The fleet is already running.")
            return
        self.deploy()

    async def action_new_session(self) -> None:
        if len(self.chat.sessions) >= min(9, self.fleet.sessions.max_sessions):
            self.notify(
                f"At most {min(9, self.fleet.sessions.max_sessions)} sessions.", severity="warning"
            )
            return
        await self.chat.new_session()
        self.query_one("#prompt", Input).focus()

    def action_cycle_session(self, step: int) -> None:
        self.chat.cycle(step)

    def action_switch_session(self, number: int) -> None:
        if not self.chat.switch_to(number):
            self.bell()

    def action_focus_prompt(self) -> None:
        self.query_one("#prompt", Input).focus()

    def action_leave_prompt(self) -> None:
        self.chat.active.focus()

    def action_fetch_logs(self) -> None:
        self.fetch_logs()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.BINDINGS))

    def action_request_quit(self) -> None:
        if isinstance(self.screen, QuitScreen):
            return
        deploying = any(worker.group == "fleet" and worker.is_running for worker in self.workers)
        running = self.ready or deploying
        self.push_screen(QuitScreen(running), self._quit_chosen)

    def _quit_chosen(self, choice: QuitChoice | None) -> None:
        if choice == "stop":
            self.quit_choice = choice
            self.stop_fleet(exit_after=True)
        elif choice == "leave":
            self.quit_choice = choice
            self.detach_fleet()

    @work(exclusive=True, group="fleet", exit_on_error=False, name="detach")
    async def detach_fleet(self) -> None:
        """Leave the workers running for the deployment record and exit."""
        self.ready = False
        for worker in self.workers:
            if worker.group.startswith("chat-"):
                worker.cancel()
        await self._stop_api()
        self.detached_lines = await self.controller.detach()
        log.info("leaving the fleet running")
        self.exit(0)

    def hang_up(self) -> None:
        """SIGHUP/SIGTERM (the terminal went away): stop the fleet this app started and exit;
        keep an attached one."""
        if self.quit_choice is not None:
            return
        if self.controller.attached:
            self.quit_choice = "leave"
            self.detach_fleet()
        else:
            self.quit_choice = "stop"
            self.stop_fleet(exit_after=True)


def run_app(fleet: Fleet, settings: Settings, args: argparse.Namespace) -> int:
    """Run the TUI on `fleet` until the operator quits; logging goes to the log pane, not the
    terminal.

    SIGHUP and SIGTERM stop the fleet this app started (or let go of an attached one) before
    exiting; if the app dies anyway, its workers are killed here, and their lease ends them if this
    process is killed."""
    import functools
    import signal

    from fleettui.control.controller import FleetController
    from fleettui.control.settings import apply, generation_params

    applied = apply(fleet, settings)
    params = generation_params(
        applied,
        getattr(args, "max_tokens", None),
        getattr(args, "temperature", None),
        getattr(args, "top_p", None),
        getattr(args, "seed", None),
        getattr(args, "no_spec", False),
        getattr(args, "spec_k", None),
    )
    api = None
    if getattr(args, "serve", False):
        from fleettui.ui.api import ApiOptions

        options = ApiOptions(args.host, args.port, args.api_key_file, applied.sessions.max_sessions)
        api = ApiService(options)  # a refused bind or key file is one line before anything starts
    from fleettui.config import paths

    app = FleetApp(
        fleet,
        functools.partial(FleetController, settings=settings),
        params,
        api=api,
        log_file=paths.log_dir() / "tui.log",
    )
    app.handle_signals = True
    root = logging.getLogger()
    streams = [handler for handler in root.handlers if isinstance(handler, logging.StreamHandler)]
    level = root.level
    for handler in streams:  # a stderr handler would scribble over the screen
        root.removeHandler(handler)
    root.setLevel(logging.DEBUG if getattr(args, "verbose", False) else logging.INFO)
    previous = {number: signal.getsignal(number) for number in (signal.SIGHUP, signal.SIGTERM)}
    try:
        code = app.run()
    finally:
        root.setLevel(level)
        for handler in streams:
            root.addHandler(handler)
        for number, previous_handler in previous.items():
            signal.signal(number, previous_handler)
        if app.quit_choice != "leave":
            _clean_up(app.controller)
    for line in app.detached_lines:
        print(f"fleettui: {line}; `fleettui stop {fleet.path}` stops it", file=sys.stderr)
    return code if isinstance(code, int) else 0


def _clean_up(controller: FleetControl) -> None:
    """After the app ended without a clean stop (a crash): let go of an attached fleet, stop a
    launched one."""
    import asyncio

    try:
        if controller.attached:
            asyncio.run(asyncio.wait_for(controller.detach(), 30))
        elif controller.worker_pids():
            asyncio.run(asyncio.wait_for(controller.stop(), 30))
    except BaseException:
        controller.kill()
