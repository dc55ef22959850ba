"""Provides the chat pane: several sessions, each an anchored scroll of prompts and streamed
Markdown replies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import ContentSwitcher, Input, Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from fleettui.text_input import TextError, check_text


class Reply(Vertical):
    """One assistant reply: Markdown streamed through `Markdown.get_stream()`, then its
    statistics line."""

    def __init__(self) -> None:
        super().__init__(classes="reply")
        self.text = ""
        self.chunks = 0  # how many deltas streamed in (more than one: it really streamed)
        self.done = False
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Markdown("", classes="reply-text")
        yield Label("…", classes="reply-stats")

    def on_mount(self) -> None:
        self._stream = Markdown.get_stream(self.query_one(Markdown))

    async def write(self, delta: str) -> None:
        if not delta:
            return
        self.text += delta
        self.chunks += 1
        assert self._stream is not None, "write() before the reply was mounted"
        await self._stream.write(delta)

    async def finish(self, stats: str, failed: bool = False) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.done = True
        self.set_class(failed, "failed")
        self.query_one(".reply-stats", Label).update(stats)


class ChatSession(VerticalScroll):
    """The transcript of one session; it follows the end of the stream unless the reader scrolls
    up."""

    def __init__(self, number: int) -> None:
        super().__init__(id=f"session-{number}", classes="chat-session")
        self.number = number
        self.handle: Any = None  # the coordinator's session, opened with the first prompt
        self.busy = False
        self.replies: list[Reply] = []

    def on_mount(self) -> None:
        self.anchor()

    async def begin_reply(self, prompt: str) -> Reply:
        """Show the prompt and an empty reply; the caller streams into the returned `Reply`."""
        reply = Reply()
        self.replies.append(reply)
        await self.mount_all([Static(prompt, classes="prompt", markup=False), reply])
        self.anchor()
        return reply


class ChatPane(Vertical):
    """Sessions in a ContentSwitcher above one prompt input; sends `PromptSubmitted` up to the
    app."""

    @dataclass
    class PromptSubmitted(Message):
        session: ChatSession
        text: str

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.sessions: list[ChatSession] = [ChatSession(1)]
        self.border_title = "chat"
        # a base model: each session is one text that the model continues
        self.completion_mode = False

    def set_completion_mode(self, on: bool) -> None:
        """Say in the pane whether prompts are chat turns or text for a base model to continue."""
        self.completion_mode = on
        self.border_title = (
            "completion mode — base model, no chat template: your text is continued"
            if on
            else "chat"
        )
        prompt = self.query_one("#prompt", Input)
        prompt.placeholder = (
            "Text to continue… (enter sends)" if on else "Ask the fleet… (enter sends)"
        )

    def compose(self) -> ComposeResult:
        yield Label("", id="session-bar")
        with ContentSwitcher(initial="session-1", id="sessions"):
            yield from self.sessions
        yield Input(placeholder="Ask the fleet… (enter sends)", id="prompt")

    def on_mount(self) -> None:
        self.draw_bar()

    @property
    def active(self) -> ChatSession:
        current = self.query_one(ContentSwitcher).current
        return next(session for session in self.sessions if session.id == current)

    async def new_session(self) -> ChatSession:
        session = ChatSession(len(self.sessions) + 1)
        self.sessions.append(session)
        await self.query_one(ContentSwitcher).mount(session)
        self.switch_to(session.number)
        return session

    def switch_to(self, number: int) -> bool:
        if not 1 <= number <= len(self.sessions):
            return False
        self.query_one(ContentSwitcher).current = f"session-{number}"
        self.draw_bar()
        return True

    def cycle(self, step: int) -> None:
        self.switch_to((self.active.number - 1 + step) % len(self.sessions) + 1)

    def draw_bar(self) -> None:
        active = self.active.number
        parts = []
        for session in self.sessions:
            label = f" {session.number}{' ⟳' if session.busy else ''} "
            parts.append(f"[reverse]{label}[/reverse]" if session.number == active else label)
        self.query_one("#session-bar", Label).update(
            "sessions:" + "".join(parts) + "   (ctrl+n new · ctrl+tab next)"
        )

    def clear_prompt(self) -> None:
        self.query_one("#prompt", Input).clear()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        try:
            check_text(text, "chat input", escapes=False)
        except (
            TextError
        ) as error:  # a pasted lone surrogate: said once, the prompt stays for editing
            self.app.notify(str(error), severity="error")
            return
        if text:
            self.post_message(self.PromptSubmitted(self.active, text))
